"""Per-device memory of full-size models on 8 devices: bf16, --fsdp, --quantize fp8 and both.

Two sources, one table each:

- the planner's model (``jaxdit.plan.cost.step_cost``) on abstract shapes (default): nothing is allocated
  or compiled. Its parameter bytes are the sharded model's exactly; working memory (one block's
  activations, fsdp's two gathered layers and the gathered weights outside the blocks) is a model;
- ``--compiled``: the pipelines' own denoising step compiled for 8 emulated CPU devices from abstract
  full-size shapes (``jaxdit.plan.verify.lower_step``, no weight allocated), and the compiled program's
  own memory analysis per device: the bytes of its arguments (parameters, latents, text) and, in
  brackets, its temporaries as the CPU backend reports them. Those include fp32 copies the CPU makes of bf16 weights (whole) and of FP8 ones
  (per layer, inside the scan), which a GPU does not make, so they bound the working memory from above
  and are no GPU figure. ``--dtype float32`` compiles the same step with fp32 weights, which the CPU
  does not copy: its temp is then the fp32 working memory, a bound from above on bf16's (every
  activation at most as wide).

Prints a Markdown table.

    python scripts/memory_table.py [--compiled] [--columns both] [--models flux2-dev]
        [--meshes ulysses8 ring2xulysses4]  # other 8-device meshes than each model's own, one row each
        [--dtype float32]  # weights (and activations) in fp32 instead of bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from jaxdit.plan.command import parse_config
from jaxdit.plan.cost import step_cost
from jaxdit.plan.search import invalid_reasons
from jaxdit.plan.workload import Workload

GiB = 2**30

#: (label, preset, Workload.create keywords, 8-device mesh)
MODELS = [
    ("FLUX.1-dev 1024x1024", "flux-dev", {}, "ulysses8"),
    ("Wan2.1-T2V-14B 720p x 81", "wan2.1-t2v-14b", dict(height=720, width=1280, frames=81), "cfg2xulysses4"),
    ("Qwen-Image 1328x1328", "qwen-image", {}, "cfg2xulysses4"),
    ("FLUX.2-dev 1024x1024", "flux2-dev", {}, "ulysses8"),
]

#: column -> (fp8, fsdp)
COLUMNS = {"bf16": (False, False), "fsdp": (False, True), "fp8": (True, False), "both": (True, True)}
HEADERS = {"bf16": "bf16", "fsdp": "--fsdp", "fp8": "--quantize fp8", "both": "both"}


def modelled(w: Workload, c) -> str:
    cost = step_cost(w, c)
    work = cost.activation_bytes + cost.kv_cache_bytes
    return f"{cost.memory_bytes / GiB:.2f} ({cost.resident_param_bytes / GiB:.2f} + {work / GiB:.2f})"


def compiled(w: Workload, c) -> str:
    """The compiled step's parameters + working memory per device (see the module docstring)."""
    from jaxdit.plan.verify import lower_step, measure

    start = time.perf_counter()
    lowered, forward = lower_step(w, c)
    m, _ = measure(lowered, forward, c)
    params, work = m.param_bytes, m.activation_bytes  # work: jaxdit plan --verify's estimate
    seconds = time.perf_counter() - start
    print(
        f"  [{w.name} {c.describe()} fp8={w.fp8}: compiled in {seconds:.0f} s; per device arguments "
        f"{m.argument_bytes / GiB:.2f} GiB (parameters {params / GiB:.2f}), temp {m.temp_bytes / GiB:.2f} GiB, "
        f"temp less whole fp32 copies of the narrow weights {work / GiB:.2f}]",
        flush=True,
    )
    return f"{m.argument_bytes / GiB:.2f} [{m.temp_bytes / GiB:.2f}]"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compiled", action="store_true", help="from compiled programs (8 emulated CPU devices)")
    p.add_argument("--columns", nargs="+", choices=tuple(COLUMNS), default=list(COLUMNS))
    p.add_argument("--models", nargs="+", choices=[m[1] for m in MODELS], default=[m[1] for m in MODELS])
    p.add_argument(
        "--meshes", nargs="+", metavar="MESH", help="rows for these meshes instead of each model's own"
    )
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="weights' dtype")
    args = p.parse_args(argv)
    try:  # a bad name is refused in one line, before any compile
        meshes = [parse_config(m) for m in args.meshes or ()]
    except ValueError as e:
        p.error(str(e))
    if args.compiled:
        from jaxdit.plan.verify import ensure_cpu_devices

        ensure_cpu_devices(8)
    cell = compiled if args.compiled else modelled
    headers = {**HEADERS, "bf16": "fp32"} if args.dtype == "float32" else HEADERS
    print("| model, mesh | " + " | ".join(headers[k] for k in args.columns) + " |")
    print("|---|" + "---|" * len(args.columns))
    for label, name, kwargs, own in MODELS:
        if name not in args.models:
            continue
        for mesh in meshes or [parse_config(own)]:
            cells = []
            for column in args.columns:
                fp8, fsdp = COLUMNS[column]
                w = Workload.create(name, fp8=fp8, dtype=args.dtype, **kwargs)
                c = dataclasses.replace(mesh, fsdp=fsdp)
                cells.append("n/a" if invalid_reasons(w, c) else cell(w, c))
            print(f"| {label}, {mesh.describe()} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
