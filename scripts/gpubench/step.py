"""One FLUX-dev 1024x1024 denoising step with random bf16 weights on one device, per backend; then the
same step with the blocks' linear weights in FP8 (FP8 matmuls where the GPU has them), timed after the
bf16 rows in the same process."""

from __future__ import annotations

import statistics
import time

import bench_gpu  # scripts/bench_gpu.py: the workloads, their inputs and the cards' peaks
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux
from jaxdit.plan.cost import step_cost

MODEL = "flux-dev"
ORDER = ("cudnn", "triton", "xla")  # cudnn first: the time left may not reach the last


def setup(dry: bool, device) -> dict:
    w = bench_gpu._workload(MODEL, dry)
    graphdef, abstract = nnx.split(flux.abstract_model(w.model, jnp.bfloat16))
    leaves, treedef = jax.tree.flatten(abstract)
    rng = np.random.default_rng(0)
    if dry:
        values = [
            jax.device_put((0.02 * rng.standard_normal(a.shape)).astype(a.dtype), device) for a in leaves
        ]
    else:  # drawn on the device: no host copy of 24 GB of weights

        @jax.jit
        def draw(key):
            keys = jax.random.split(key, len(leaves))
            return [0.02 * jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves, strict=True)]

        values = jax.block_until_ready(draw(jax.random.key(0)))
    state = jax.tree.unflatten(treedef, values)
    return {
        "workload": w,
        "inputs": bench_gpu._inputs(w),
        "model": nnx.merge(graphdef, state),
        "state": state,
    }


def run(s: dict, backend: str, dry: bool, device, ceiling_tflops: float | None) -> dict:
    w, x, state = s["workload"], s["inputs"], s["state"]
    mesh = ParallelConfig().make_mesh([device])
    forward = flux.sharded(s["model"], mesh, kernel={"backend": backend})
    layout = forward.layout({n: tuple(v.shape) for n, v in x.items()})
    names = tuple(n for n in flux.FORWARD_INPUTS if n in x)
    args = []
    for n in names:
        arg, v = flux.FORWARD_INPUTS[n], np.asarray(x[n])
        if arg.group is not None:
            v = layout.pad(v, arg.group, axis=arg.seq_axis)
        if v.dtype == np.float32 and n in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
            v = v.astype(jnp.bfloat16)
        args.append(jax.device_put(v, forward.sharding(arg)))
    start = time.perf_counter()
    compiled = forward.step(layout, names).lower(state, *args).compile()
    compile_seconds = time.perf_counter() - start
    for _ in range(2):
        jax.block_until_ready(compiled(state, *args))
    times = []
    for _ in range(3 if dry else 10):
        t = time.perf_counter()
        jax.block_until_ready(compiled(state, *args))
        times.append(time.perf_counter() - t)
    seconds = statistics.median(times)
    cost = step_cost(w, ParallelConfig())
    peak = bench_gpu._peak(device.device_kind, None)
    tflops = cost.flops / seconds / 1e12
    return {
        "part": "step",
        "model": MODEL,
        "backend": backend,
        "status": "ok",
        "param_gb": forward.param_bytes_per_device() / 1e9,
        "compile_seconds": compile_seconds,
        "seconds": seconds,
        "tflops": tflops,
        "mfu_vs_peak": cost.flops / seconds / peak if peak else None,
        "mfu_vs_ceiling": tflops / ceiling_tflops if ceiling_tflops else None,
    }


def run_fp8(
    s: dict, backend: str, dry: bool, device, ceiling_tflops: float | None, bf16_seconds: float
) -> dict:
    """The step again with FP8 weights (in place: the bf16 kernels are freed as each layer is replaced)."""
    from jaxdit.models.fp8 import choose_mode
    from jaxdit.models.quantize import quantize_model

    mode = choose_mode(None, [device])
    s.pop("state")  # its bf16 kernels would outlive the swap
    quantize_model(s["model"], mode)
    s["state"] = nnx.split(s["model"])[1]
    row = run(s, backend, dry, device, ceiling_tflops)
    return {
        **row,
        "backend": f"{backend}+fp8",
        "fp8_mode": mode,
        "speedup_vs_bf16": bf16_seconds / row["seconds"],
    }
