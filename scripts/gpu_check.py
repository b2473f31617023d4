"""One GPU, one command: is each attention kernel right and fast at this project's shapes, and how fast
is a whole transformer step with each?

(a) Every attention backend that runs here against ``xla`` (and against the XLA kernel on the same
    inputs in fp32), at the shapes one device sees after Ulysses' all-to-all (the whole sequence, H/U
    heads, shard-major with the layout's padding keys masked):
    - FLUX.1-dev 1024 x 1024 on ulysses6: 512 text + 4096 image tokens, padded to 516 + 4098 (6 padding
      keys inside the sequence), 24/6 = 4 heads;
    - Wan2.1-T2V-1.3B 480p x 81 on cfg2 x ulysses4: 32,760 tokens, 12/4 = 3 heads;
    - Wan2.1-T2V-14B 720p x 81 on ulysses8: 75,600 tokens, 5 heads;
    all batch 1, head_dim 128, bf16: max |error| of the output and of the fp32 log-sum-exp.
(b) Each backend's attention TFLOP/s there (4 B H T^2 D FLOPs over the padded length / median time).
(c) One FLUX.1-dev 1024 x 1024 step and one Wan2.1-T2V-1.3B 480p x 81 step (batch 1, random bf16 weights
    built on the device, as ``scripts/bench_gpu.py`` does) with each backend (fused kernels first, xla
    last): compile time, median step time, TFLOP/s and MFU against the card's dense bf16 peak; where
    torch and diffusers are installed (not needed), diffusers' model on the same card and inputs
    (``bench_gpu.py``'s worker; eager, ``--torch-compile`` adds torch.compile), with what time is left.

What it costs, by design (one H100/H200, three backends there: xla, cudnn, triton): (a)+(b) 3 shapes x 3
backends x (compile + 1 warm-up + ``--reps`` 10 timed calls) + 3 fp32 references, the slowest call XLA's
at 14B (14.6 TFLOP, ~0.25 s): about a minute with the process start; (c) 2 models x 3 backends x (compile
+ first call + 1 warm-up + ``--steps`` 5 timed), the slowest Wan-1.3B's XLA step (~280 TFLOP, ~3.5 s):
three to five minutes. The whole run is held to ``--budget`` (default 450 s, under 8 minutes): each part
gets a share of what is left (a part that finishes early leaves its time to the next), each row a limit
of its own.

Never stops midway: each row (one shape or model with one backend) is a unit. A row that raises records
its error and the next row runs; each part runs in its own process, so a row that kills the process (a
crash inside XLA or a kernel) or overruns its limit is recorded as an error and the part is restarted
after it, skipping the rows done. ``--out`` is rewritten after every row (atomically; ``"complete":
false`` until the end), so whatever was measured survives anything; ``jaxdit plan --calibration FILE``
reads it. Needs jax (0.10.2 and later) with its GPU plugin; no network, no torch.

    python scripts/gpu_check.py --out gpu_check.json [--budget 450] [--no-torch] [--torch-compile]
    python scripts/gpu_check.py --tiny --out tiny.json   # tiny shapes on a CPU, in one process

With ``--tiny`` on a CPU the attention rows also run the Pallas kernels (triton, splash) in Pallas'
interpreter; ``--workers`` runs the parts in worker processes as a GPU run does. The backends come from
:func:`available_backends`, the one place that knows the kernel layer.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

# This checkout's jaxdit, whatever the working directory or another install (the workers inherit it).
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_gpu  # noqa: E402  (sibling script: workloads, inputs, timing, peaks, the diffusers worker)

MODELS = tuple(bench_gpu.MODELS)  # flux-dev, wan2.1-t2v-1.3b
#: Targets the fused kernels are meant to meet on an H200 (the GPU issue's acceptance figures).
from gpucheck.report import TARGET_CUDNN_TFLOPS, TARGET_FLUX_MFU  # noqa: E402,F401

#: Share of the remaining budget each part gets when it starts, and the most one row may take (compile
#: included) before it is stopped and recorded as an error.
PART_SHARE = {"attention": 1.0, "step": 1.5}
ROW_LIMIT_SECONDS = {"attention": 150.0, "step": 300.0}
#: A part's worker is restarted after a crash at most this many times.
MAX_RESTARTS = 3
#: Test hooks: rows whose key contains one of these ;-separated strings raise (FAIL) or end the worker
#: process at once (CRASH), to check that a run goes on after either.
FAIL_ENV, CRASH_ENV = "GPU_CHECK_FAIL", "GPU_CHECK_CRASH"
Emit = Callable[[dict], None]

from gpucheck.cases import CASES, TINY_CASES, AttentionCase, _row_fields, row_key  # noqa: E402,F401
from gpucheck.report import _fmt, _targets, format_report  # noqa: E402,F401
from gpucheck.results import Results  # noqa: E402,F401

# ----------------------------------------------------------------------------------------------------
# The kernel layer, in one place.


def _kernels():
    if importlib.util.find_spec("jaxdit.parallel.kernels") is None:
        return None
    from jaxdit.parallel import kernels

    return kernels


def available_backends(platform_name: str, interpret: bool = False) -> list[str]:
    """The attention backends that would really run on this platform for bf16, head_dim 128 (a backend
    that would fall back to another is left out): ``xla`` first. ``interpret``: the Pallas kernels in
    Pallas' interpreter count as running (a CPU check)."""
    kernels = _kernels()
    if kernels is None:
        return ["xla"]
    import jax.numpy as jnp

    shape = (1, 128, 1, 128)
    runs = []
    for b in kernels.BACKENDS:
        try:
            choice = kernels.backend_for(platform_name, jnp.bfloat16, shape, requested=b, interpret=interpret)
        except Exception as e:  # noqa: BLE001 - a backend the host cannot even judge is not run
            print(f"gpu_check: backend {b}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if choice.backend == b:
            runs.append(b)
    return ["xla"] + [b for b in runs if b != "xla"]


def kernel_options(backend: str, interpret: bool = False) -> dict | None:
    """The models' ``kernel`` option selecting ``backend`` (None: the default, the XLA kernel)."""
    if _kernels() is None:
        return None
    return {
        "backend": backend,
        **({"interpret": True} if interpret and backend in ("triton", "splash") else {}),
    }


def attention_fn(backend: str, interpret: bool = False) -> Callable:
    """``f(q, k, v, key_valid) -> (out, lse fp32)`` computed by ``backend``."""
    from jaxdit.parallel.local_attention import local_attention

    options = kernel_options(backend, interpret) or {}
    return lambda q, k, v, key_valid: local_attention(q, k, v, key_valid, **options)


# ----------------------------------------------------------------------------------------------------
# Rows


def _inject(key: str) -> None:
    """The test hooks (FAIL_ENV, CRASH_ENV)."""
    for env, crash in ((CRASH_ENV, True), (FAIL_ENV, False)):
        marks = [m for m in os.environ.get(env, "").split(";") if m]
        if any(m in key for m in marks):
            if crash:
                sys.stdout.flush()
                os._exit(70)
            raise RuntimeError(f"injected failure ({env})")


def _run_row(emit: Emit, begin: Callable[[str], None], key: str, measure: Callable[[], dict]) -> None:
    """One row: announce it, measure it, emit its record, or its error (and go on)."""
    begin(key)
    try:
        _inject(key)
        record = measure()
    except Exception as e:  # noqa: BLE001 - one row's failure is recorded, the run goes on
        traceback.print_exc()
        record = {"error": f"{type(e).__name__}: {e}"[:2000]}
    emit({**_row_fields(key), **record})


def _attempt(fn: Callable, what: str):
    """``fn()``, or None (said on stderr) when it raises: for values a row can do without."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        print(f"gpu_check: {what}: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _median_seconds(fn, args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _max_error(a, b, rows) -> float | None:
    """max |a - b| over the real query rows (the models drop padded queries); None without b."""
    import numpy as np

    if b is None:
        return None
    return float(np.abs(np.asarray(a, np.float32)[:, rows] - np.asarray(b, np.float32)[:, rows]).max())


def _max_abs(a, rows) -> float | None:
    """max |a| over the real query rows (what a relative bound multiplies); None without a."""
    import numpy as np

    if a is None:
        return None
    return float(np.abs(np.asarray(a, np.float32)[:, rows]).max())


def _no_begin(key: str) -> None:
    pass


# ----------------------------------------------------------------------------------------------------
# (a) + (b): attention


def attention_worker(
    emit: Emit, tiny: bool, reps: int, skip=frozenset(), begin: Callable[[str], None] = _no_begin
) -> None:
    import jax

    device = jax.devices()[0]
    interpret = tiny and device.platform == "cpu"
    emit(_device_record(device, interpret))
    backends = available_backends(device.platform, interpret)
    for case in TINY_CASES if tiny else CASES:
        todo = [b for b in backends if row_key("attention", case.name, b) not in skip]
        if todo:
            _attention_case(case, todo, interpret, reps, device, emit, begin)


def _attention_case(case: AttentionCase, todo, interpret: bool, reps: int, device, emit, begin) -> None:
    """The rows of one shape: each backend in ``todo`` timed and held to xla and to the fp32 reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    valid = case.key_valid()
    t = len(valid)

    def inputs():
        # Drawn and cast on the host (numpy): no eager jax op, so nothing compiles but the kernels.
        rng = np.random.default_rng(0)
        shape = (case.batch, t, case.heads, case.head_dim)
        qkv = [jax.device_put(rng.standard_normal(shape, np.float32).astype(jnp.bfloat16)) for _ in "qkv"]
        # As the models call it: a key mask only where the layout pads (Wan's lengths here need none).
        mask = None if valid.all() else jax.device_put(np.broadcast_to(valid, (case.batch, t)))
        return (*qkv, mask)

    args = _attempt(inputs, f"{case.name}: inputs")

    def reference():  # the fp32 reference: XLA on the same values
        with jax.default_matmul_precision("highest"):
            upcast = lambda *a: attention_fn("xla")(*(x.astype(jnp.float32) for x in a[:3]), a[3])
            return jax.block_until_ready(jax.jit(upcast)(*args))

    exact = _attempt(reference, f"{case.name}: fp32 reference") if args is not None else None
    base = None  # the xla backend's (out, lse) on these inputs

    def measure(backend: str) -> dict:
        nonlocal base
        if args is None:
            raise RuntimeError("the inputs could not be placed on the device (see stderr)")
        fn = jax.jit(attention_fn(backend, interpret))
        out, lse = jax.block_until_ready(fn(*args))
        seconds = _median_seconds(fn, args, reps)
        if backend == "xla":
            base = (out, lse)
        elif base is None:  # xla's row ran in an earlier process, or failed
            base = _attempt(lambda: jax.jit(attention_fn("xla"))(*args), f"{case.name}: xla baseline")
        versus = lambda ref, i, x: _max_error(x, None if ref is None else ref[i], valid)
        return {
            "interpret": backend in ("triton", "splash") and interpret,
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
            "err_out_vs_xla": versus(base, 0, out),
            "err_lse_vs_xla": versus(base, 1, lse),
            "err_out_vs_fp32": versus(exact, 0, out),
            "err_lse_vs_fp32": versus(exact, 1, lse),
            # max |fp32 reference| over the real rows: what a relative bound multiplies
            "out_scale": None if exact is None else _max_abs(exact[0], valid),
            "lse_scale": None if exact is None else _max_abs(exact[1], valid),
            "device": device.device_kind,
        }

    for backend in todo:
        _run_row(emit, begin, row_key("attention", case.name, backend), lambda b=backend: measure(b))


# ----------------------------------------------------------------------------------------------------
# (c): a transformer step per backend


def step_order(backends: list[str]) -> list[str]:
    """The order steps run in: the fused kernels first (the numbers the run is for), xla last."""
    return [b for b in backends if b != "xla"] + [b for b in backends if b == "xla"]


def step_worker(
    emit: Emit,
    model_name: str,
    tiny: bool,
    steps: int,
    skip=frozenset(),
    begin: Callable[[str], None] = _no_begin,
) -> None:
    import jax

    device = jax.devices()[0]
    emit(_device_record(device))
    todo = [
        b
        for b in step_order(available_backends(device.platform))
        if row_key("step", model_name, b) not in skip
    ]
    if not todo:
        return
    try:
        setup = _step_setup(model_name, tiny, device)
    except Exception as e:  # noqa: BLE001 - every row of this model records why
        traceback.print_exc()
        for backend in todo:
            emit(
                {
                    **_row_fields(row_key("step", model_name, backend)),
                    "error": f"setup: {type(e).__name__}: {e}",
                }
            )
        return
    for backend in todo:
        measure = lambda backend=backend: _step_row(setup, model_name, backend, tiny, steps, device)
        _run_row(emit, begin, row_key("step", model_name, backend), measure)


def _step_setup(model_name: str, tiny: bool, device) -> dict:
    """The model with random bf16 weights on ``device`` and its inputs (numpy), shared by every backend."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxdit.models import flux, wan

    w = bench_gpu._workload(model_name, tiny)
    x = bench_gpu._inputs(w)
    module = flux if w.family.name == "flux" else wan
    graphdef, abstract = nnx.split(module.abstract_model(w.model, jnp.bfloat16))
    leaves, treedef = jax.tree.flatten(abstract)

    @jax.jit
    def _random(key):  # each leaf in its own dtype, on the device: no host copy of the weights
        keys = jax.random.split(key, len(leaves))
        return [0.02 * jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves, strict=True)]

    if tiny:  # drawn on the host: compiling the many-leaf random program costs more than a tiny step
        rng = np.random.default_rng(0)
        values = [
            jax.device_put((0.02 * rng.standard_normal(a.shape)).astype(a.dtype), device) for a in leaves
        ]
    else:
        values = jax.block_until_ready(_random(jax.random.key(0)))
    state = jax.tree.unflatten(treedef, values)
    if w.family.name == "wan":
        grid = wan.latent_grid(x["hidden_states"].shape, w.model.patch_size)
        x = dict(x, hidden_states=wan.patchify(x["hidden_states"], w.model.patch_size))  # numpy
        x["positions"] = wan.token_positions(grid)
    return {"workload": w, "inputs": x, "module": module, "model": nnx.merge(graphdef, state), "state": state}


def _step_row(setup: dict, model_name: str, backend: str, tiny: bool, steps: int, device) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdit.mesh import ParallelConfig
    from jaxdit.plan.cost import step_cost

    w, x, module, state = setup["workload"], setup["inputs"], setup["module"], setup["state"]
    mesh = ParallelConfig().make_mesh([device])
    # Tiny: XLA's quickest compile (the numbers mean nothing on a CPU; the path is what is checked).
    quick = {"xla_backend_optimization_level": 0} if tiny else None
    forward = module.sharded(setup["model"], mesh, kernel=kernel_options(backend), compiler_options=quick)
    layout = forward.layout({n: tuple(v.shape) for n, v in x.items()})
    names = tuple(n for n in module.FORWARD_INPUTS if n in x)
    args = []
    for n in names:  # padded and cast on the host, then placed: the step is the only program compiled
        arg, v = module.FORWARD_INPUTS[n], np.asarray(x[n])
        if arg.group is not None:
            v = layout.pad(v, arg.group, axis=arg.seq_axis)
        if v.dtype == np.float32 and n in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
            v = v.astype(jnp.bfloat16)
        args.append(jax.device_put(v, forward.sharding(arg)))
    start = time.perf_counter()
    compiled = forward.step(layout, names).lower(state, *args).compile()
    compile_seconds = time.perf_counter() - start
    _, times = bench_gpu._timed(lambda: compiled(state, *args), steps, jax.block_until_ready)
    seconds = statistics.median(times)
    cost = step_cost(w, ParallelConfig())
    peak = bench_gpu._peak(device.device_kind, None)
    return {
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


# ----------------------------------------------------------------------------------------------------
# The parent: workers within the budget


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_part(
    command: Callable[[list[str]], list[str]], part: str, deadline: float, results: Results, row_limit: float
) -> None:
    """Run a worker (``command(skip) -> argv``) until its rows are done, restarting it after a row that
    crashed or overran ``row_limit``, skipping the rows done; stop at ``deadline``.

    A worker prints ``BEGIN key`` before a row and ``RESULT json`` after it (a row's error included).
    """
    done: set[str] = set()
    restarts = 0
    while True:
        left = deadline - time.monotonic()
        if left < 1:
            results.note(f"{part}: out of its share of the budget; rows not run are missing")
            return
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(command(sorted(done)), stdout=subprocess.PIPE, stderr=err, text=True)
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
            current, began, stopped = None, time.monotonic(), None
            while True:
                now = time.monotonic()
                wait = deadline - now if current is None else min(deadline, began + row_limit) - now
                try:
                    line = lines.get(timeout=max(wait, 0.01))
                except queue.Empty:
                    stopped = (
                        "the time budget"
                        if time.monotonic() >= deadline
                        else f"its {row_limit:.0f} s row limit"
                    )
                    proc.kill()
                    break
                if line is None:
                    break
                if line.startswith("BEGIN "):
                    current, began = line[len("BEGIN ") :].strip(), time.monotonic()
                elif line.startswith("RESULT "):
                    try:
                        record = json.loads(line[len("RESULT ") :])
                    except ValueError:  # cut short by a kill: the row's error is recorded below
                        continue
                    results.add(record)
                    if record.get("key"):
                        done.add(record["key"])
                        current = None
            code = proc.wait()
            err.seek(0)
            log = err.read()
        sys.stderr.write(log)  # the worker's warnings and tracebacks, for the session's log
        tail = log.strip().splitlines()[-1][:300] if log.strip() else ""
        if stopped is None and code == 0:
            return
        why = (
            f"stopped at {stopped}"
            if stopped
            else f"worker exited with code {code}" + (f" ({tail})" if tail else "")
        )
        if current is None:  # died outside any row (start-up, setup): nothing to skip, so no retry
            results.note(f"{part}: {why} outside any row; its remaining rows are missing")
            return
        results.add({**_row_fields(current), "error": f"{why} while running this row"})
        done.add(current)
        if stopped == "the time budget":
            results.note(f"{part}: out of its share of the budget; rows not run are missing")
            return
        restarts += 1
        if restarts > MAX_RESTARTS:
            results.note(f"{part}: {restarts} worker failures; its remaining rows are not run")
            return
        print(f"gpu_check: {part}: {why}; restarting it after {current}", file=sys.stderr, flush=True)


def _configure_runtime(no_cache: bool) -> None:
    """jaxdit's GPU XLA flags and compilation cache, before jax starts (a rerun reads its compiles); a
    cache directory that cannot be used leaves the cache off, it does not stop the run."""
    from jaxdit import runtime

    try:
        runtime.configure(no_cache=no_cache)
    except (ValueError, OSError) as e:
        print(f"gpu_check: compilation cache off: {e}", file=sys.stderr)
        runtime.configure(no_cache=True)


def _device_record(device, interpret: bool = False) -> dict:
    """What a worker ran on (the parent never starts jax on the GPU: the workers need its memory), and
    the attention backends that run there."""
    import jax

    return {
        "part": "device",
        "device": device.device_kind,
        "platform": device.platform,
        "backends": available_backends(device.platform, interpret),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "jaxdit": str(Path(sys.modules["jaxdit"].__file__).parent) if "jaxdit" in sys.modules else None,
    }


def _jaxdit_parts(args, deadline: float, results: Results) -> None:
    """(a)-(c) with jax: in this process (--tiny), else one worker process per part within the budget."""
    if args.tiny and not args.workers:  # nothing to isolate, and a CPU imports jax once
        _configure_runtime(args.no_compilation_cache)
        attention_worker(results.add, True, min(args.reps, 3))
        for model in args.models:
            step_worker(results.add, model, True, min(args.steps, 2))
        return
    jobs = [("attention", None)] + [("step", m) for m in args.models]
    for i, (worker, model) in enumerate(jobs):
        shares = [PART_SHARE[w] for w, _ in jobs[i:]]
        part_deadline = time.monotonic() + (deadline - time.monotonic()) * shares[0] / sum(shares)
        base = [
            os.path.abspath(__file__),
            "--worker",
            worker,
            "--steps",
            str(args.steps),
            "--reps",
            str(args.reps),
        ]
        base += (["--model", model] if model else []) + (["--tiny"] if args.tiny else [])
        base += ["--no_compilation_cache"] if args.no_compilation_cache else []
        command = lambda skip, base=base: [sys.executable, *base, *(a for k in skip for a in ("--skip", k))]
        name = f"{worker} {model}" if model else worker
        run_part(command, name, part_deadline, results, ROW_LIMIT_SECONDS[worker])
        print(f"[{name}] done at {time.monotonic() - results.started:.0f} s", file=sys.stderr, flush=True)


def _have_torch() -> bool:
    """torch and diffusers installed (found, not imported: the parent keeps off the GPU)."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "diffusers"))


def _run_diffusers(argv: list[str], timeout: float) -> tuple[list[dict], str]:
    """bench_gpu.py's diffusers worker; its RESULT lines are its records."""
    try:
        proc = subprocess.run(
            [sys.executable, *argv], capture_output=True, text=True, timeout=max(timeout, 1)
        )
        out, err, note = proc.stdout, proc.stderr, "" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        note = f"stopped at the time budget ({timeout:.0f} s)"
    records = []
    for line in out.splitlines():
        if line.startswith("RESULT "):
            with contextlib.suppress(ValueError):  # a line cut short by the budget
                records.append(json.loads(line[len("RESULT ") :]))
    if note and err.strip():
        note += ": " + err.strip().splitlines()[-1][:300]
    return records, note


def _diffusers_parts(args, deadline: float, results: Results) -> None:
    """diffusers' models through ``bench_gpu.py``'s worker, one process per model, with what is left."""
    if args.no_torch:
        return
    if not _have_torch():
        results.note("diffusers: not run (torch/diffusers not installed)")
        return
    for model in args.models:
        left = deadline - time.monotonic()
        if left < (1 if args.tiny else 30):
            results.note(f"diffusers {model}: no time left in the budget")
            continue
        steps = min(args.steps, 2) if args.tiny else args.steps
        argv = [bench_gpu.__file__, "--worker", "torch", "--model", model, "--steps", str(steps)]
        argv += (["--tiny"] if args.tiny else []) + ([] if args.torch_compile else ["--no-torch-compile"])
        got, note = _run_diffusers(argv, left)
        for record in got:
            results.add({**record, "part": "diffusers"})
        if note:
            results.note(f"diffusers {model}: {note}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write every record as JSON here, after every row")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for everything (default 450)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per backend (median reported)")
    p.add_argument("--reps", type=int, default=10, help="timed attention calls per backend and shape")
    p.add_argument("--no-torch", "--no_torch", dest="no_torch", action="store_true", help="skip diffusers")
    p.add_argument("--torch-compile", action="store_true", help="diffusers with torch.compile as well")
    p.add_argument("--no-compilation-cache", "--no_compilation_cache", dest="no_compilation_cache",
                   action="store_true", help="compile afresh (default: jaxdit's persistent cache)")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="tiny shapes and models, in one process (a CPU check)")
    p.add_argument("--workers", action="store_true", help="with --tiny: run the parts in worker processes")
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"models whose step is timed, comma-separated (default {','.join(MODELS)}; 'none': no steps)",
    )
    p.add_argument("--worker", choices=("attention", "step"), help=argparse.SUPPRESS)
    p.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    p.add_argument("--skip", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m.strip() and m != "none"]
    if unknown := sorted(set(args.models) - set(MODELS)):
        p.error(f"unknown --models {unknown}; known: {', '.join(MODELS)}")

    if args.worker:
        _configure_runtime(args.no_compilation_cache)
        emit = lambda r: print("RESULT " + json.dumps(r), flush=True)
        begin = lambda key: print(f"BEGIN {key}", flush=True)
        skip = frozenset(args.skip)
        if args.worker == "attention":
            attention_worker(emit, args.tiny, args.reps, skip, begin)
        else:
            step_worker(emit, args.model, args.tiny, args.steps, skip, begin)
        return 0

    deadline = time.monotonic() + args.budget
    results = Results(args.out, args.tiny)
    results.write()
    try:
        _jaxdit_parts(args, deadline, results)
        _diffusers_parts(args, deadline, results)
    except Exception as e:  # noqa: BLE001 - whatever was measured is kept; the failure is recorded
        traceback.print_exc()
        results.note(f"gpu_check itself failed: {type(e).__name__}: {e}")
    data = results.data(complete=True)
    results.write(complete=True)
    print(format_report(data))
    if not results.part("device"):
        print("gpu_check: no worker reported a device; " + "; ".join(results.notes), file=sys.stderr)
        return 1
    ok = any("error" not in r for r in data["attention"]) and (
        not args.models or any("error" not in r for r in data["steps"])
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
