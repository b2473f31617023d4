"""One GPU, one transformer step: jaxdit against diffusers on the same card and the same inputs.

Times the full-size FLUX.1-dev transformer at 1024 x 1024 (4096 image + 512 text tokens) and
Wan2.1-T2V-1.3B at 480 x 832 x 81 frames (32,760 video tokens + 512 text tokens), batch 1 (one guidance
branch), random bf16 weights (the step's speed does not depend on their values). For each: compile time,
the median of several timed steps after warm-up, FLOPs per step (the cost model, ``jaxdit.plan.cost``,
which matches the compiled HLO's dot count) and model FLOP utilisation against the card's dense bf16
peak. Where torch and diffusers are installed, diffusers' model (``FluxTransformer2DModel``,
``WanTransformer3DModel``; SDPA attention) runs on the same card with the same input values, eager and
with ``torch.compile``, and the ratio is printed.

Each (framework, model) runs in its own subprocess, so each has the whole card and a crash or a hang
stays contained; the parent keeps a time budget (default 450 s, within 8 minutes) and gives each worker
what is left. A worker prints its eager result before it tries ``torch.compile``, so a budget that runs
out mid-compile still reports eager numbers.

    python scripts/bench_gpu.py [--out bench_gpu.json] [--steps 5] [--no-torch] [--no-torch-compile]
    python scripts/bench_gpu.py --tiny      # tiny models and sizes: checks the script on a CPU

Record the printed table in docs/BENCHMARKS.md with the date, the card and the versions it prints.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time

#: Dense bf16 peak FLOP/s by device-kind substring (datasheets, without sparsity), most specific first.
PEAK_BF16 = (
    ("GH200", 989.4e12),
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("H800", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362.1e12),
    ("L4", 121e12),
)

MODELS = {
    # name -> (jaxdit preset, height, width, frames)
    "flux-dev": ("flux-dev", 1024, 1024, 1),
    "wan2.1-t2v-1.3b": ("wan2.1-t2v-1.3b", 480, 832, 81),
}
TINY = {"flux-dev": (64, 64, 1), "wan2.1-t2v-1.3b": (64, 96, 9)}


# ----------------------------------------------------------------------------------------------------
# Shared by both workers: the configuration and the inputs (numpy, from a seed, so both frameworks get
# the same values).


def _workload(name: str, tiny: bool):
    from jaxdit.models.flux import FluxConfig
    from jaxdit.models.wan import WanConfig
    from jaxdit.plan.workload import Workload

    preset, h, w, f = MODELS[name]
    if not tiny:
        return Workload.create(preset, height=h, width=w, frames=f, branches=1)
    h, w, f = TINY[name]
    if name.startswith("flux"):
        cfg = FluxConfig(
            in_channels=64,
            out_channels=64,
            vec_in_dim=32,
            context_in_dim=64,
            hidden_size=128,
            num_heads=4,
            depth=2,
            depth_single_blocks=2,
            axes_dim=(8, 12, 12),
            guidance_embed=True,
        )
        return Workload.for_config(cfg, name="flux-tiny", height=h, width=w, text_tokens=16, branches=1)
    cfg = WanConfig(dim=128, ffn_dim=256, num_heads=4, num_layers=2, text_dim=64)
    return Workload.for_config(cfg, name="wan-tiny", height=h, width=w, frames=f, text_tokens=16, branches=1)


def _describe(w) -> str:
    h, wd, f = w.size
    frames = f" x {f} frames" if w.family.name == "wan" else ""
    return f"{w.name} {wd}x{h}{frames}: {' + '.join(map(str, w.tokens))} tokens, batch 1, {w.dtype}"


def _inputs(w) -> dict:
    """diffusers-layout inputs (numpy fp32, ids/positions as the pipelines make them), seeded."""
    import numpy as np

    rng = np.random.default_rng(0)
    m = w.model
    height, width, frames = w.size
    if w.family.name == "flux":
        text, image = w.tokens
        h, wd = height // 16, width // 16
        ids = np.zeros((image, 3), np.float32)
        ids[:, 1], ids[:, 2] = np.repeat(np.arange(h), wd), np.tile(np.arange(wd), h)
        return {
            "hidden_states": rng.standard_normal((1, image, m.in_channels), np.float32),
            "encoder_hidden_states": rng.standard_normal((1, text, m.context_in_dim), np.float32),
            "pooled_projections": rng.standard_normal((1, m.vec_in_dim), np.float32),
            "timestep": np.array([0.5], np.float32),
            "img_ids": ids,
            "txt_ids": np.zeros((text, 3), np.float32),
            "guidance": np.array([3.5], np.float32),
        }
    latent = (1, m.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    return {
        "hidden_states": rng.standard_normal(latent, np.float32),
        "encoder_hidden_states": rng.standard_normal((1, w.context[0], m.text_dim), np.float32),
        "timestep": np.array([500.0], np.float32),
    }


def _timed(fn, steps: int, sync) -> tuple[float, list[float]]:
    """(first call seconds: compile included, [step seconds]) after one more warm-up call."""
    start = time.perf_counter()
    sync(fn())
    first = time.perf_counter() - start
    sync(fn())  # warm-up, excluded
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - start)
    return first, times


def _emit(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


# ----------------------------------------------------------------------------------------------------
# Workers


def jax_worker(name: str, steps: int, tiny: bool) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxdit import hlo_stats
    from jaxdit.mesh import ParallelConfig
    from jaxdit.models import flux, wan
    from jaxdit.plan.cost import step_cost

    w = _workload(name, tiny)
    x = _inputs(w)
    module = flux if w.family.name == "flux" else wan
    device = jax.devices()[0]
    start = time.perf_counter()
    graphdef, abstract = nnx.split(module.abstract_model(w.model, jnp.bfloat16))
    leaves, treedef = jax.tree.flatten(abstract)

    @jax.jit
    def _random(key):
        # Drawn in each leaf's own dtype, on the device: no fp32 copy of the bf16 weights.
        keys = jax.random.split(key, len(leaves))
        return [
            0.02 * jax.random.normal(k, leaf.shape, leaf.dtype) for k, leaf in zip(keys, leaves, strict=True)
        ]

    state = jax.tree.unflatten(treedef, jax.block_until_ready(_random(jax.random.key(0))))
    init_seconds = time.perf_counter() - start
    forward = module.sharded(nnx.merge(graphdef, state), ParallelConfig().make_mesh([device]))
    if w.family.name == "wan":
        cfg = w.model
        grid = wan.latent_grid(x["hidden_states"].shape, cfg.patch_size)
        x = {
            "hidden_states": module.patchify(jnp.asarray(x["hidden_states"]), cfg.patch_size),
            "positions": wan.token_positions(grid),
            "timestep": x["timestep"],
            "encoder_hidden_states": x["encoder_hidden_states"],
        }
    # The compiled step on device-resident inputs: no padding or host transfer inside the timing.
    layout = forward.layout({k: tuple(v.shape) for k, v in x.items()})
    names = tuple(n for n in module.FORWARD_INPUTS if n in x)
    args = []
    for n in names:
        arg, v = module.FORWARD_INPUTS[n], jnp.asarray(x[n])
        if arg.group is not None:
            v = layout.pad(v, arg.group, axis=arg.seq_axis)
        if v.dtype == jnp.float32 and n in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
            v = v.astype(jnp.bfloat16)
        args.append(jax.device_put(v, forward.sharding(arg)))
    step = forward.step(layout, names)
    start = time.perf_counter()
    compiled = step.lower(state, *args).compile()
    compile_seconds = time.perf_counter() - start
    hlo_flops = hlo_stats.flops_per_device(compiled)
    first, times = _timed(lambda: compiled(state, *args), steps, jax.block_until_ready)
    _emit(
        {
            "framework": "jaxdit",
            "model": name,
            "workload": _describe(w),
            "compile_seconds": compile_seconds,
            "device": device.device_kind,
            "platform": device.platform,
            "init_seconds": init_seconds,
            "first_call_seconds": first,
            "step_seconds": times,
            "median_seconds": statistics.median(times),
            "flops_model": step_cost(w, ParallelConfig()).flops,
            "flops_hlo": hlo_flops,
            "versions": {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib")},
        }
    )


def torch_worker(name: str, steps: int, tiny: bool, use_compile: bool) -> None:
    import torch
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    w = _workload(name, tiny)
    x = _inputs(w)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    m = w.model
    torch.manual_seed(0)
    start = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)  # build the weights in bf16 directly (no fp32 copy)
    with torch.device(device):
        if w.family.name == "flux":
            model = FluxTransformer2DModel(
                in_channels=m.in_channels,
                num_layers=m.depth,
                num_single_layers=m.depth_single_blocks,
                attention_head_dim=m.head_dim,
                num_attention_heads=m.num_heads,
                joint_attention_dim=m.context_in_dim,
                pooled_projection_dim=m.vec_in_dim,
                guidance_embeds=m.guidance_embed,
                axes_dims_rope=tuple(m.axes_dim),
            )
        else:
            model = WanTransformer3DModel(
                num_attention_heads=m.num_heads,
                attention_head_dim=m.head_dim,
                in_channels=m.in_channels,
                out_channels=m.out_channels,
                text_dim=m.text_dim,
                freq_dim=m.freq_dim,
                ffn_dim=m.ffn_dim,
                num_layers=m.num_layers,
            )
    torch.set_default_dtype(torch.float32)
    model = model.eval().requires_grad_(False)
    init_seconds = time.perf_counter() - start
    t = {}
    for k, v in x.items():
        v = torch.from_numpy(v).to(device)
        if k in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
            v = v.to(torch.bfloat16)
        t[k] = v
    sync = (lambda out: torch.cuda.synchronize()) if cuda else (lambda out: None)
    record = {
        "framework": "diffusers",
        "model": name,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "init_seconds": init_seconds,
        "versions": {"torch": torch.__version__, "diffusers": __import__("diffusers").__version__},
    }
    with torch.inference_mode():
        first, times = _timed(lambda: model(**t, return_dict=False)[0], steps, sync)
        record.update(
            mode="eager",
            first_call_seconds=first,
            step_seconds=times,
            median_seconds=statistics.median(times),
        )
        _emit(record)
        if use_compile:
            compiled = torch.compile(model)
            first, times = _timed(lambda: compiled(**t, return_dict=False)[0], steps, sync)
            record.update(
                mode="torch.compile",
                first_call_seconds=first,
                step_seconds=times,
                median_seconds=statistics.median(times),
            )
            _emit(record)


# ----------------------------------------------------------------------------------------------------
# The parent: runs the workers within the budget and prints the table


def _peak(device: str, override: float | None) -> float | None:
    if override:
        return override * 1e12
    for key, peak in PEAK_BF16:
        if key in device:
            return peak
    return None


def _run_worker(argv: list[str], timeout: float) -> tuple[list[dict], str]:
    cmd = [sys.executable, os.path.abspath(__file__), *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1))
        out, err, note = proc.stdout, proc.stderr, "" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        note = f"stopped at the time budget ({timeout:.0f} s)"
    records = [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]
    if note and err.strip():
        note += ": " + err.strip().splitlines()[-1][:300]
    return records, note


def _have_torch() -> bool:
    try:
        import diffusers  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--steps", type=int, default=5, help="timed steps after warm-up (median reported)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for everything (default 450)")
    p.add_argument("--no-torch", action="store_true", help="skip diffusers")
    p.add_argument("--no-torch-compile", action="store_true", help="diffusers eager only")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak, if the card is unknown")
    p.add_argument("--tiny", action="store_true", help="tiny models and sizes (a CPU check of the script)")
    p.add_argument("--out", default=None, help="write every record as JSON here")
    p.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker == "jax":
        jax_worker(args.model, args.steps, args.tiny)
        return 0
    if args.worker == "torch":
        torch_worker(args.model, args.steps, args.tiny, not args.no_torch_compile)
        return 0

    deadline = time.monotonic() + args.budget
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(models) - set(MODELS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
    use_torch = not args.no_torch and _have_torch()
    common = ["--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
    jobs = [("jax", m) for m in models] + ([("torch", m) for m in models] if use_torch else [])
    records, notes = [], []
    for i, (framework, model) in enumerate(jobs):
        # Whatever is left, less a minute for each job after this one (a full-size compile takes about
        # that); a job that finishes early leaves its time to the next.
        timeout = deadline - time.monotonic() - 60 * (len(jobs) - i - 1)
        extra = ["--no-torch-compile"] if args.no_torch_compile else []
        got, note = _run_worker(["--worker", framework, "--model", model, *common, *extra], timeout)
        records += got
        if note:
            notes.append(f"{framework} {model}: {note}")
        print(f"[{framework} {model}] {len(got)} result(s){' - ' + note if note else ''}", file=sys.stderr)

    print(format_results(records, args.peak_tflops, use_torch, notes))
    if args.out:
        meta = {
            "date": datetime.date.today().isoformat(),
            "host": platform.node(),
            "python": platform.python_version(),
            "tiny": args.tiny,
            "notes": notes,
        }
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0 if any(r["framework"] == "jaxdit" for r in records) else 1


def format_results(records: list[dict], peak_tflops: float | None, torch_ran: bool, notes: list[str]) -> str:
    lines = [f"bench_gpu {datetime.date.today().isoformat()}"]
    jax_rows = [r for r in records if r["framework"] == "jaxdit"]
    if jax_rows:
        r = jax_rows[0]
        lines.append(f"device: {r['device']} ({r['platform']}); jax {r['versions']['jax']}")
    torch_rows = [r for r in records if r["framework"] == "diffusers"]
    if torch_rows:
        v = torch_rows[0]["versions"]
        lines.append(f"torch {v['torch']}, diffusers {v['diffusers']}")
    elif not torch_ran:
        lines.append("diffusers: not run (torch/diffusers not installed or --no-torch)")
    header = f"{'model':<18} {'framework':<24} {'compile':>9} {'median step':>12} {'TFLOP/step':>11} {'TFLOP/s':>9} {'MFU':>7} {'jaxdit speed':>13}"
    lines += ["", header, "-" * len(header)]
    for model in MODELS:
        mine = [r for r in jax_rows if r["model"] == model]
        if not mine:
            continue
        j = mine[0]
        flops = j["flops_model"]
        peak = _peak(j["device"], peak_tflops)
        for r in mine + [r for r in torch_rows if r["model"] == model]:
            name = "jaxdit" if r["framework"] == "jaxdit" else f"diffusers {r['mode']}"
            rate = flops / r["median_seconds"]
            mfu = f"{rate / peak:.1%}" if peak else "n/a"
            ratio = r["median_seconds"] / j["median_seconds"]
            # jaxdit: lower + compile; diffusers: its first call (torch.compile's compile happens there).
            first = r.get("compile_seconds", r["first_call_seconds"])
            lines.append(
                f"{model:<18} {name:<24} {first:>8.1f}s {r['median_seconds'] * 1e3:>10.1f}ms "
                f"{flops / 1e12:>11.2f} {rate / 1e12:>9.1f} {mfu:>7} {ratio:>12.2f}x"
            )
        lines.append(f"{'':<18} ({j['workload']}; HLO FLOPs / model = {j['flops_hlo'] / flops:.4f})")
    lines.append(
        "compile: jaxdit's lower + compile, diffusers' first call. jaxdit speed: the row's median step time / "
        "jaxdit's (above 1: jaxdit is faster). MFU: TFLOP/step (the cost model) / median step / dense bf16 peak."
    )
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
