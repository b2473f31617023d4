"""One GPU, one command: is each attention kernel right and fast at this project's shapes, and how fast
is a whole transformer step with each?

(a) Every attention backend that runs here against ``xla`` (and against the XLA kernel on the same
    inputs in fp32), at the shapes one device sees after Ulysses' all-to-all (the whole sequence, H/U
    heads, shard-major with the layout's padding keys masked):
    - FLUX.1-dev 1024 x 1024 on ulysses6: 512 text + 4096 image tokens, padded to 516 + 4098 (6 padding
      keys inside the sequence), 24/6 = 4 heads;
    - Wan2.1-T2V-1.3B 480p x 81 on cfg2 x ulysses4: 32,760 tokens, 12/4 = 3 heads;
    - Wan2.1-T2V-14B 720p x 81 on ulysses8: 75,600 tokens, 40/8 = 5 heads;
    all batch 1, head_dim 128, bf16: max |error| of the output and of the fp32 log-sum-exp.
(b) Each backend's attention TFLOP/s there (4 B H T^2 D FLOPs over the padded length / median time).
(c) One FLUX.1-dev 1024 x 1024 step and one Wan2.1-T2V-1.3B 480p x 81 step (batch 1, random bf16 weights
    built on the device, as ``scripts/bench_gpu.py`` does) with each backend: compile time, median step
    time, TFLOP/s and MFU against the card's dense bf16 peak; where torch and diffusers are installed,
    diffusers' model on the same card and inputs (``bench_gpu.py``'s worker; eager, ``--torch-compile``
    adds torch.compile).

Each part runs in its own process within a time budget (default 450 s: the whole script stays under 8
minutes on one H100/H200); a part stopped by the budget leaves what it finished. The table goes to
stdout, every record to ``--out`` as JSON, which ``jaxdit plan --calibration FILE`` reads.

    python scripts/gpu_check.py --out gpu_check.json [--budget 450] [--no-torch] [--torch-compile]
    python scripts/gpu_check.py --tiny --out tiny.json   # tiny shapes on a CPU, in one process

The backends come from :func:`available_backends`, the one place that knows the kernel layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu  # noqa: E402  (sibling script: workloads, inputs, timing, peaks, the diffusers worker)

MODELS = tuple(bench_gpu.MODELS)  # flux-dev, wan2.1-t2v-1.3b
#: Targets the fused kernels are meant to meet on an H200 (the GPU issue's acceptance figures).
TARGET_CUDNN_TFLOPS = 500.0
TARGET_FLUX_MFU = 0.50
Emit = Callable[[dict], None]


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """The attention one device computes after Ulysses' all-to-all over ``degree`` sequence shards."""

    name: str
    lengths: tuple[int, ...]  # global token groups (FLUX: text, image)
    degree: int  # ulysses (x ring) shards the layout pads for
    heads: int  # heads on the device (H / U)
    head_dim: int = 128
    batch: int = 1

    def key_valid(self):
        """[T] bool in the order the device holds the tokens: shard by shard, each shard's groups joined,
        each group padded to a multiple of the degree (``jaxdit.parallel.layout``)."""
        import numpy as np

        local = [math.ceil(n / self.degree) for n in self.lengths]
        parts = [
            s * n_local + np.arange(n_local) < n
            for s in range(self.degree)
            for n, n_local in zip(self.lengths, local, strict=True)
        ]
        return np.concatenate(parts)

    def flops(self) -> float:
        t = len(self.key_valid())
        return 4.0 * self.batch * self.heads * t * t * self.head_dim


CASES = (
    AttentionCase("flux-dev 1024px, ulysses6", (512, 4096), 6, 4),
    AttentionCase("wan2.1-1.3b 480p x 81, cfg2 x ulysses4", (32_760,), 4, 3),
    AttentionCase("wan2.1-14b 720p x 81, ulysses8", (75_600,), 8, 5),
)
TINY_CASES = (
    AttentionCase("flux-tiny, ulysses3", (5, 30), 3, 2, head_dim=16),
    AttentionCase("wan-tiny, ulysses2", (60,), 2, 2, head_dim=16),
    AttentionCase("wan-tiny, ulysses4", (75,), 4, 1, head_dim=16),
)


# ----------------------------------------------------------------------------------------------------
# The kernel layer, in one place. Until ``jaxdit.parallel.kernels`` exists only the XLA kernel runs.


def _kernels():
    if importlib.util.find_spec("jaxdit.parallel.kernels") is None:
        return None
    from jaxdit.parallel import kernels

    return kernels


def available_backends(platform_name: str) -> list[str]:
    """The attention backends that would really run on this platform for bf16, head_dim 128 (a backend
    that would fall back to another is left out): ``xla`` first."""
    kernels = _kernels()
    if kernels is None:
        return ["xla"]
    import jax.numpy as jnp

    shape = (1, 128, 1, 128)
    runs = [
        b
        for b in kernels.BACKENDS
        if kernels.backend_for(platform_name, jnp.bfloat16, shape, requested=b).backend == b
    ]
    return ["xla"] + [b for b in runs if b != "xla"]


def kernel_options(backend: str) -> dict | None:
    """The models' ``kernel`` option selecting ``backend`` (None: the default, today's XLA kernel)."""
    return None if _kernels() is None else {"backend": backend}


def attention_fn(backend: str) -> Callable:
    """``f(q, k, v, key_valid) -> (out, lse fp32)`` computed by ``backend``."""
    from jaxdit.parallel.local_attention import local_attention

    options = kernel_options(backend) or {}
    return lambda q, k, v, key_valid: local_attention(q, k, v, key_valid, **options)


# ----------------------------------------------------------------------------------------------------
# (a) + (b): attention


def _median_seconds(fn, args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _max_error(a, b, rows) -> float:
    """max |a - b| over the real query rows (the models drop padded queries)."""
    import numpy as np

    return float(np.abs(np.asarray(a, np.float32)[:, rows] - np.asarray(b, np.float32)[:, rows]).max())


def _max_abs(a, rows) -> float:
    """max |a| over the real query rows."""
    import numpy as np

    return float(np.abs(np.asarray(a, np.float32)[:, rows]).max())


def attention_worker(emit: Emit, tiny: bool, reps: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    device = jax.devices()[0]
    emit(_device_record(device))
    backends = available_backends(device.platform)
    for case in TINY_CASES if tiny else CASES:
        valid = case.key_valid()
        t = len(valid)
        # Inputs drawn and cast on the host (numpy): no eager jax op, so nothing compiles but the kernels.
        rng = np.random.default_rng(0)
        shape = (case.batch, t, case.heads, case.head_dim)
        q, k, v = (jax.device_put(rng.standard_normal(shape, np.float32).astype(jnp.bfloat16)) for _ in "qkv")
        mask = jax.device_put(np.broadcast_to(valid, (case.batch, t)))

        with jax.default_matmul_precision("highest"):  # the fp32 reference: XLA on the same values
            upcast = lambda *a: attention_fn("xla")(*(x.astype(jnp.float32) for x in a[:3]), a[3])
            exact = jax.jit(upcast)(q, k, v, mask)
        results = {}
        for backend in backends:
            fn = jax.jit(attention_fn(backend))
            out, lse = fn(q, k, v, mask)
            results[backend] = (out, lse)
            seconds = _median_seconds(fn, (q, k, v, mask), reps)
            base_out, base_lse = results["xla"]
            emit(
                {
                    "part": "attention",
                    "case": case.name,
                    "backend": backend,
                    "shape": {
                        "batch": case.batch,
                        "tokens": t,
                        "valid_tokens": int(valid.sum()),
                        "heads": case.heads,
                        "head_dim": case.head_dim,
                    },  # fmt: skip
                    "flops": case.flops(),
                    "seconds": seconds,
                    "tflops": case.flops() / seconds / 1e12,
                    "err_out_vs_xla": _max_error(out, base_out, valid),
                    "err_lse_vs_xla": _max_error(lse, base_lse, valid),
                    "err_out_vs_fp32": _max_error(out, exact[0], valid),
                    "err_lse_vs_fp32": _max_error(lse, exact[1], valid),
                    # max |fp32 reference| over the real rows: what a relative bound multiplies
                    "out_scale": _max_abs(exact[0], valid),
                    "lse_scale": _max_abs(exact[1], valid),
                    "device": device.device_kind,
                }
            )


# ----------------------------------------------------------------------------------------------------
# (c): a transformer step per backend


def step_worker(emit: Emit, model_name: str, tiny: bool, steps: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxdit.mesh import ParallelConfig
    from jaxdit.models import flux, wan
    from jaxdit.plan.cost import step_cost

    w = bench_gpu._workload(model_name, tiny)
    x = bench_gpu._inputs(w)
    module = flux if w.family.name == "flux" else wan
    device = jax.devices()[0]
    emit(_device_record(device))
    mesh = ParallelConfig().make_mesh([device])
    graphdef, abstract = nnx.split(module.abstract_model(w.model, jnp.bfloat16))
    leaves, treedef = jax.tree.flatten(abstract)

    @jax.jit
    def _random(key):  # each leaf in its own dtype, on the device: no host copy of the weights
        keys = jax.random.split(key, len(leaves))
        return [0.02 * jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves, strict=True)]

    if tiny:  # drawn on the host: compiling the many-leaf random program costs more than a tiny step
        rng = np.random.default_rng(0)
        values = [jax.device_put((0.02 * rng.standard_normal(a.shape)).astype(a.dtype)) for a in leaves]
    else:
        values = jax.block_until_ready(_random(jax.random.key(0)))
    state = jax.tree.unflatten(treedef, values)
    model = nnx.merge(graphdef, state)
    if w.family.name == "wan":
        grid = wan.latent_grid(x["hidden_states"].shape, w.model.patch_size)
        x = dict(x, hidden_states=wan.patchify(x["hidden_states"], w.model.patch_size))  # numpy
        x["positions"] = wan.token_positions(grid)
    cost = step_cost(w, ParallelConfig())
    for backend in available_backends(device.platform):
        # Tiny: XLA's quickest compile (the numbers mean nothing on a CPU; the path is what is checked).
        quick = {"xla_backend_optimization_level": 0} if tiny else None
        forward = module.sharded(model, mesh, kernel=kernel_options(backend), compiler_options=quick)
        layout = forward.layout({n: tuple(v.shape) for n, v in x.items()})
        names = tuple(n for n in module.FORWARD_INPUTS if n in x)
        args = []
        for n in names:  # padded and cast on the host, then placed: the step is the only program compiled
            arg, v = module.FORWARD_INPUTS[n], np.asarray(x[n])
            if arg.group is not None:
                v = layout.pad(v, arg.group, axis=arg.seq_axis)
            if v.dtype == np.float32 and n in (
                "hidden_states",
                "encoder_hidden_states",
                "pooled_projections",
            ):
                v = v.astype(jnp.bfloat16)
            args.append(jax.device_put(v, forward.sharding(arg)))
        start = time.perf_counter()
        compiled = forward.step(layout, names).lower(state, *args).compile()
        compile_seconds = time.perf_counter() - start
        _, times = bench_gpu._timed(lambda c=compiled, a=args: c(state, *a), steps, jax.block_until_ready)
        seconds = statistics.median(times)
        peak = bench_gpu._peak(device.device_kind, None)
        emit(
            {
                "part": "step",
                "model": model_name,
                "backend": backend,
                "workload": bench_gpu._describe(w),
                "compile_seconds": compile_seconds,
                "step_seconds": times,
                "seconds": seconds,
                "flops": cost.flops,
                "attention_flops": cost.attention_flops,
                "tflops": cost.flops / seconds / 1e12,
                "mfu": cost.flops / seconds / peak if peak else None,
                "device": device.device_kind,
            }
        )


# ----------------------------------------------------------------------------------------------------
# The parent


def _run(argv: list[str], timeout: float) -> tuple[list[dict], str]:
    """Run this script (or bench_gpu.py for diffusers) as a worker; RESULT lines are its records."""
    try:
        proc = subprocess.run(
            [sys.executable, *argv], capture_output=True, text=True, timeout=max(timeout, 1)
        )
        out, err, note = proc.stdout, proc.stderr, "" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        note = f"stopped at the time budget ({timeout:.0f} s)"
    records = [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]
    if note and err.strip():
        note += ": " + err.strip().splitlines()[-1][:300]
    return records, note


def _configure_runtime(no_cache: bool) -> None:
    """jaxdit's GPU XLA flags and compilation cache, before jax starts (a rerun reads its compiles)."""
    from jaxdit import runtime

    runtime.configure(no_cache=no_cache)


def format_report(data: dict) -> str:
    meta = data["meta"]
    lines = [
        f"gpu_check {meta['date']}: {meta['device']} ({meta['platform']}); jax {meta['jax']}, "
        f"jaxlib {meta['jaxlib']}; backends: {', '.join(meta['backends'])}"
        + (" [tiny]" if meta["tiny"] else "")
    ]
    head = f"{'attention case':<40} {'backend':<8} {'tokens':>7} {'TFLOP/s':>8} {'out-xla':>9} {'lse-xla':>9} {'out-fp32':>9} {'lse-fp32':>9}"
    lines += ["", head, "-" * len(head)]
    for r in data["attention"]:
        lines.append(
            f"{r['case']:<40} {r['backend']:<8} {r['shape']['tokens']:>7} {r['tflops']:>8.3g} "
            f"{r['err_out_vs_xla']:>9.2e} {r['err_lse_vs_xla']:>9.2e} {r['err_out_vs_fp32']:>9.2e} {r['err_lse_vs_fp32']:>9.2e}"
        )
    head = f"{'step':<18} {'runs':<24} {'compile':>9} {'median step':>12} {'TFLOP/s':>8} {'MFU':>7}"
    lines += ["", head, "-" * len(head)]
    for r in data["steps"]:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "n/a"
        lines.append(
            f"{r['model']:<18} {'jaxdit ' + r['backend']:<24} {r['compile_seconds']:>8.1f}s "
            f"{r['seconds'] * 1e3:>10.1f}ms {r['tflops']:>8.3g} {mfu:>7}"
        )
    for r in data["diffusers"]:
        step = next((s for s in data["steps"] if s["model"] == r["model"]), None)
        rate = step["flops"] / r["median_seconds"] / 1e12 if step else float("nan")
        lines.append(
            f"{r['model']:<18} {'diffusers ' + r['mode']:<24} {r['first_call_seconds']:>8.1f}s "
            f"{r['median_seconds'] * 1e3:>10.1f}ms {rate:>8.3g} {'':>7}"
        )
    lines += ["", *(f"target: {t}" for t in data["targets"]), *(f"note: {n}" for n in meta["notes"])]
    lines.append(
        "out/lse-xla: max |error| against the xla backend on the same bf16 inputs; -fp32: against the XLA "
        "kernel on those inputs in fp32 (real query rows only). TFLOP/s: 4 B H T^2 D over the padded length "
        "(attention), the cost model's FLOPs (steps; diffusers: the same FLOPs over its time). compile: "
        "jaxdit's lower + compile, diffusers' first call."
    )
    return "\n".join(lines)


def _targets(attention: list[dict], steps: list[dict], tiny: bool) -> list[str]:
    if tiny:
        return ["not judged at tiny sizes"]
    out = []
    flux_att = [r for r in attention if r["backend"] == "cudnn" and r["case"].startswith("flux")]
    out.append(
        f"cuDNN attention >= {TARGET_CUDNN_TFLOPS:.0f} TFLOP/s at FLUX's shape: "
        + (f"{flux_att[0]['tflops']:.0f}" if flux_att else "cudnn did not run")
    )
    flux_steps = [r for r in steps if r["model"] == "flux-dev" and r.get("mfu")]
    best = max(flux_steps, key=lambda r: r["mfu"], default=None)
    out.append(
        f"FLUX-dev step MFU >= {TARGET_FLUX_MFU:.0%}: "
        + (f"{best['mfu']:.1%} ({best['backend']})" if best else "no FLUX step with a known peak")
    )
    return out


def _device_record(device) -> dict:
    """What a worker ran on (the parent never starts jax on the GPU: the workers need its memory)."""
    import jax

    return {
        "part": "device",
        "device": device.device_kind,
        "platform": device.platform,
        "backends": available_backends(device.platform),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
    }


def _jaxdit_parts(args, deadline: float) -> tuple[list[dict], list[str]]:
    """(a)-(c) with jax: in this process (--tiny), else one worker process per part within the budget."""
    records: list[dict] = []
    notes: list[str] = []
    if args.tiny:  # nothing to isolate, and a CPU imports jax once
        _configure_runtime(args.no_compilation_cache)
        attention_worker(records.append, True, min(args.reps, 3))
        for model in MODELS:
            step_worker(records.append, model, True, min(args.steps, 2))
        return records, notes
    jobs = [("attention", None)] + [("step", m) for m in MODELS]
    for i, (worker, model) in enumerate(jobs):
        # What is left, less a minute for each later job (a full-size compile takes about that).
        timeout = deadline - time.monotonic() - 60 * (len(jobs) - i - 1)
        argv = [
            os.path.abspath(__file__),
            "--worker",
            worker,
            "--steps",
            str(args.steps),
            "--reps",
            str(args.reps),
        ]
        argv += (["--model", model] if model else []) + (
            ["--no_compilation_cache"] if args.no_compilation_cache else []
        )
        got, note = _run(argv, timeout)
        records += got
        if note:
            notes.append(f"{worker} {model or ''}: {note}")
        print(f"[{worker} {model or ''}] {len(got)} result(s){' - ' + note if note else ''}", file=sys.stderr)
    return records, notes


def _diffusers_parts(args, deadline: float) -> tuple[list[dict], list[str]]:
    """diffusers' models through ``bench_gpu.py``'s worker, one process per model, with what is left."""
    if args.no_torch:
        return [], []
    if not bench_gpu._have_torch():
        return [], ["diffusers: not run (torch/diffusers not installed)"]
    records, notes = [], []
    for model in MODELS:
        steps = min(args.steps, 2) if args.tiny else args.steps
        argv = [bench_gpu.__file__, "--worker", "torch", "--model", model, "--steps", str(steps)]
        argv += (["--tiny"] if args.tiny else []) + ([] if args.torch_compile else ["--no-torch-compile"])
        got, note = _run(argv, max(deadline - time.monotonic(), 60 if args.tiny else 1))
        records += got
        if note:
            notes.append(f"diffusers {model}: {note}")
    return records, notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write every record as JSON here (jaxdit plan --calibration)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for everything (default 450)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per backend (median reported)")
    p.add_argument("--reps", type=int, default=10, help="timed attention calls per backend and shape")
    p.add_argument("--no-torch", action="store_true", help="skip diffusers")
    p.add_argument("--torch-compile", action="store_true", help="diffusers with torch.compile as well")
    p.add_argument("--no-compilation-cache", "--no_compilation_cache", dest="no_compilation_cache",
                   action="store_true", help="compile afresh (default: jaxdit's persistent cache)")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="tiny shapes and models, in one process (a CPU check)")
    p.add_argument("--worker", choices=("attention", "step"), help=argparse.SUPPRESS)
    p.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        _configure_runtime(args.no_compilation_cache)
        emit = lambda r: print("RESULT " + json.dumps(r), flush=True)
        if args.worker == "attention":
            attention_worker(emit, args.tiny, args.reps)
        else:
            step_worker(emit, args.model, args.tiny, args.steps)
        return 0

    deadline = time.monotonic() + args.budget
    records, notes = _jaxdit_parts(args, deadline)
    diffusers, torch_notes = _diffusers_parts(args, deadline)
    device = next((r for r in records if r["part"] == "device"), None)
    if device is None:
        print("gpu_check: no worker reported a device; " + "; ".join(notes), file=sys.stderr)
        return 1
    attention = [r for r in records if r["part"] == "attention"]
    steps = [r for r in records if r["part"] == "step"]
    meta = {k: v for k, v in device.items() if k != "part"}
    meta.update(
        date=datetime.date.today().isoformat(),
        host=platform.node(),
        python=platform.python_version(),
        tiny=args.tiny,
        notes=notes + torch_notes,
    )
    data = {
        "meta": meta,
        "attention": attention,
        "steps": steps,
        "diffusers": diffusers,
        "targets": _targets(attention, steps, args.tiny),
    }
    print(format_report(data))
    if args.out:
        tmp = Path(args.out).with_name(Path(args.out).name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(args.out)  # atomic: a reader never sees half a file
    return 0 if attention and steps else 1


if __name__ == "__main__":
    sys.exit(main())
