"""``jaxdit plan``: its flags and what it runs (jaxdit/cli.py only dispatches here).

jaxdit plan --model flux-dev --height 1024 --width 1024 --devices 8 --link nvlink [--json]
jaxdit plan --model flux-dev --devices 8 --attention_backend cudnn [--attention_tflops 520 | --calibration gpu_check.json]
jaxdit plan --model flux-dev --devices 8 --cache fbcache:0.35   # a cache skipping 35% of block evaluations
jaxdit plan --model wan2.1-t2v-14b --height 720 --width 1280 --frames 81 --devices 8 --verify \\
    --configs ulysses8,ring8,ring2xulysses4,cfg2xulysses4,tensor2xulysses4

Argument parsing imports nothing heavy; jax is imported when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

from jaxdit.mesh import MESH_AXES

_TOKEN = re.compile(rf"({'|'.join(MESH_AXES)})\s*=?\s*(\d+)$")


def parse_config(text: str):
    """``ring2xulysses4``, ``ring2 x ulysses4``, ``ring=2,ulysses=4`` (within one config: x or +), or
    ``single`` -> ParallelConfig; ``+ fsdp`` (as ``describe`` writes it) shards the blocks' weights."""
    from jaxdit.mesh import ParallelConfig

    text = text.strip().lower()
    if text in ("single", "single device", "1"):
        return ParallelConfig()
    degrees: dict[str, int] = {}
    fsdp = False
    for part in re.split(r"\s*[x+]\s*", text):
        if part.strip() == "fsdp":
            fsdp = True
            continue
        m = _TOKEN.match(part.strip())
        if not m:
            raise ValueError(f"cannot read {part!r} in configuration {text!r}; write e.g. ring2xulysses4")
        if m.group(1) in degrees:
            raise ValueError(f"{m.group(1)} given twice in {text!r}")
        degrees[m.group(1)] = int(m.group(2))
    return ParallelConfig(**degrees, fsdp=fsdp)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="flux-dev", help="a preset: {presets} (default flux-dev)")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the model's)")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None, help="video frames, 4n+1 (Wan; default 81)")
    p.add_argument("--devices", type=int, required=True, help="devices for one generation")
    p.add_argument("--link", default="nvlink", choices=("nvlink", "pcie", "ib"), help="link between devices")
    p.add_argument("--bandwidth", type=float, default=None, help="GB/s per device per direction (effective)")
    p.add_argument("--latency-us", type=float, default=None, help="microseconds per collective")
    p.add_argument(
        "--tflops",
        type=float,
        default=None,
        help="achieved matmul TFLOP/s per device, attention aside (default 450)",
    )
    p.add_argument(
        "--attention_backend",
        "--attention-backend",
        default="auto",
        choices=("auto", "xla", "cudnn", "triton", "splash"),
        help="attention kernel to model (default auto: cuDNN for bf16/fp16, XLA for fp32, as jaxdit picks "
        "on an NVIDIA GPU)",
    )
    p.add_argument(
        "--attention_tflops",
        "--attention-tflops",
        type=float,
        default=None,
        help="the attention kernel's measured TFLOP/s (default: tokamax's H100 figures: cudnn 680, "
        "triton 390, xla 62)",
    )
    p.add_argument(
        "--calibration",
        default=None,
        metavar="GPU_CHECK_JSON",
        help="take the attention (and, from its steps, matmul) rates from a scripts/gpu_check.py --out file",
    )
    p.add_argument("--memory-gb", type=float, default=None, help="memory per device (default 80)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--requests", type=int, default=1, help="independent generations (for data parallelism)")
    cfg = p.add_mutually_exclusive_group()
    cfg.add_argument("--cfg", dest="branches", action="store_const", const=2, help="classifier-free guidance")
    cfg.add_argument("--no-cfg", dest="branches", action="store_const", const=1, help="no CFG (one branch)")
    p.add_argument("--text-tokens", type=int, default=None, help="prompt tokens (default 512)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument(
        "--offload-idle-expert",
        dest="offload_idle_expert",
        action="store_true",
        help="two-expert models (Wan 2.2 A14B): only the running expert on the devices, the other in host memory",
    )
    p.add_argument("--quantize", choices=("fp8",), default=None, help="fp8: price the transformer blocks' "
                   "linear weights in FP8, as `jaxdit generate --quantize fp8` holds them")  # fmt: skip
    p.add_argument("--fsdp", action="store_true", help="every configuration with its blocks' weights sharded "
                   "over the mesh and gathered per layer, as `jaxdit generate --fsdp` runs them")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the plan (and verification) as JSON")
    p.add_argument(
        "--verify",
        action="store_true",
        help="compile each configuration's full-size step on emulated CPU devices and compare",
    )
    p.add_argument(
        "--configs",
        default=None,
        help="comma-separated configurations to --verify (default: every valid one), e.g. "
        "ulysses8,ring8,ring2xulysses4",
    )
    p.add_argument("--threads", type=int, default=2, help="concurrent compiles for --verify")
    p.add_argument("--cache", default=None, metavar="NAME:FRACTION", help="a feature cache's expected "
                   "skipped fraction of block evaluations, e.g. fbcache:0.35 or teacache:0.5 (approximate)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Plan (and verify); prints a table or JSON. Raises ValueError on bad arguments."""
    from jaxdit.plan.cache import cache_json, check_skip, format_cache
    from jaxdit.plan.latency import DEFAULT_MEMORY_GB, DEFAULT_TFLOPS, Hardware, read_calibration
    from jaxdit.plan.report import add_attention_json, format_plan, format_verify, format_verify_pipefusion
    from jaxdit.plan.search import plan
    from jaxdit.plan.workload import Workload

    if args.configs and not args.verify:  # it would change nothing: say so rather than ignore it
        raise ValueError("--configs chooses the configurations --verify compiles; add --verify")
    workload = Workload.create(
        args.model,
        height=args.height,
        width=args.width,
        frames=args.frames,
        steps=args.steps,
        branches=args.branches,
        requests=args.requests,
        text_tokens=args.text_tokens,
        dtype=args.dtype,
        offload_idle_expert=args.offload_idle_expert,
        fp8=args.quantize == "fp8",
    )
    hw = Hardware(
        link=args.link,
        bandwidth_gbs=args.bandwidth,
        latency_s=None if args.latency_us is None else args.latency_us * 1e-6,
        # None is "not given"; a 0 given is refused by Hardware, not replaced by the default.
        tflops=DEFAULT_TFLOPS if args.tflops is None else args.tflops,
        memory_gb=DEFAULT_MEMORY_GB if args.memory_gb is None else args.memory_gb,
        attention_backend=args.attention_backend,
        attention_tflops=args.attention_tflops,
    )
    if args.calibration:
        # The kernel the plan would use, then that kernel's measured rates (flags given explicitly win).
        backend = hw.attention_kernel(workload.dtype, workload.head_dim).backend
        measured = read_calibration(args.calibration, backend)
        hw = dataclasses.replace(
            hw,
            attention_tflops=args.attention_tflops or measured["attention_tflops"],
            attention_source=None if args.attention_tflops else measured["source"],
            tflops=args.tflops or measured["tflops"] or hw.tflops,
        )
    report = plan(workload, args.devices, hw, fsdp=args.fsdp)
    cache = check_skip(args.cache, report) if args.cache else None
    data = report.to_json() if args.json else None
    if data is not None:
        add_attention_json(data, report)
    if not args.json:
        print(format_plan(report), flush=True)
    if cache is not None:
        if args.json:
            data["cache"] = cache_json(report, *cache)
        else:
            print("\n" + format_cache(report, *cache), flush=True)

    if args.verify:
        from jaxdit.plan.verify import (
            ensure_cpu_devices,
            pipefusion_not_compilable,
            verify,
            verify_pipefusion,
        )

        if args.configs:
            parsed = [parse_config(c) for c in args.configs.split(",") if c.strip()]
            if args.fsdp:
                parsed = [dataclasses.replace(c, fsdp=True) for c in parsed]
            chosen = [report.find(c) for c in parsed]
            bad = [f"{p.name}: {'; '.join(p.reasons)}" for p in chosen if not p.valid]
            if bad:
                raise ValueError("cannot verify invalid configurations: " + " | ".join(bad))
        else:
            chosen = list(report.plans)
        # Before anything asks jax for its devices (the PipeFusion check below builds meshes): jax fixes
        # its device count when it first starts.
        ensure_cpu_devices(max([p.config.num_devices for p in chosen] + [1]))
        compile_now = [p for p in chosen if p.config.pipefusion == 1]
        # PipeFusion compiles the runner's two programs (warm-up step, pipelined phase), where the runner
        # can use the plan's patch count.
        skipped = {
            p.name: why
            for p in chosen
            if p.config.pipefusion > 1 and (why := pipefusion_not_compilable(workload, p.config))
        }
        pipefusion = [p for p in chosen if p.config.pipefusion > 1 and p.name not in skipped]
        say = (lambda s: print(f"  {s}", file=sys.stderr, flush=True)) if not args.json else None
        comparisons = (
            verify(workload, [p.config for p in compile_now], threads=args.threads, progress=say)
            if compile_now
            else []
        )
        pf_comparisons = verify_pipefusion(
            workload, [p.config for p in pipefusion], threads=args.threads, progress=say
        )
        if args.json:
            data["verify"] = (
                [c.to_json() for c in comparisons]
                + [c.to_json() for c in pf_comparisons]
                + [{"config": name, "not_compiled": why} for name, why in skipped.items()]
            )
        else:
            if comparisons:
                print()
                print(format_verify(workload.describe(), comparisons))
            if pf_comparisons:
                print()
                print(format_verify_pipefusion(pf_comparisons))
            for name, why in skipped.items():
                print(f"not compiled: {name}: {why}")
    if args.json:
        print(json.dumps(data, indent=1))
    return 0
