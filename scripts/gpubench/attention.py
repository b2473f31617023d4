"""Per-device attention, judged before it is timed.

Inputs have a sharp softmax (queries scaled by ``SHARPEN``): on flat standard-normal inputs a kernel that
ignores the key mask or rescales wrongly moves the log-sum-exp by ~1e-3 and nothing flags it. Before the
judged call, the same program runs once on NaN inputs and its results are freed, so the allocator hands
back NaN-filled buffers: an output element the kernel never writes is caught by the finite check. A row
that fails any bound is marked failed and not timed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from gpubench.timing import batched_median
from jaxdit.parallel import kernels
from jaxdit.parallel.local_attention import local_attention

SHARPEN = 3.5
#: Bounds against the fp32 reference on the same bf16 values: |LSE - fp32| (natural log, absolute) and
#: ||out - fp32|| / ||fp32|| over all queries. bf16 rounding of the probabilities alone gives ~4e-3.
LSE_BOUND, REL_L2_BOUND = 2e-2, 2e-2
BACKENDS = ("cudnn", "triton", "xla")
TARGET_CUDNN_TFLOPS = 500.0


@dataclasses.dataclass(frozen=True)
class Case:
    """The attention one device computes after Ulysses' all-to-all over ``degree`` shards."""

    name: str
    lengths: tuple[int, ...]  # global token groups (FLUX: text, image)
    degree: int
    heads: int  # heads on the device
    head_dim: int = 128
    chip_filling: bool = False  # the shape the cuDNN target is judged at

    def key_valid(self) -> np.ndarray:
        """[T] bool, shard by shard, each group padded to a multiple of the degree (as the layout pads)."""
        local = [math.ceil(n / self.degree) for n in self.lengths]
        parts = [
            s * m + np.arange(m) < n
            for s in range(self.degree)
            for n, m in zip(self.lengths, local, strict=True)
        ]
        return np.concatenate(parts)

    def flops(self) -> float:
        t = len(self.key_valid())
        return 4.0 * self.heads * t * t * self.head_dim


CASES = (
    Case("flux-dev 1024px ulysses4 (per device)", (512, 4096), 4, 6),
    Case("flux-dev 1024px one device, 24 heads", (512, 4096), 1, 24, chip_filling=True),
    Case("flux-dev 1024px ulysses6 (padding keys)", (512, 4096), 6, 4),
    Case("wan2.1-1.3b 480p ulysses4", (32_760,), 4, 3),
    Case("wan2.1-14b 720p ulysses8", (75_600,), 8, 5),
)
DRY_CASES = (
    Case("flux-tiny ulysses3 (padding keys)", (5, 30), 3, 2, head_dim=16),
    Case("flux-tiny one device", (5, 30), 1, 4, head_dim=16, chip_filling=True),
)


def inputs(case: Case, seed: int = 0):
    t = len(case.key_valid())
    rng = np.random.default_rng(seed)
    shape = (1, t, case.heads, case.head_dim)
    q, k, v = (rng.standard_normal(shape, np.float32) for _ in range(3))
    q = (SHARPEN * q).astype(jnp.bfloat16)
    return q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), case.key_valid()[None]


def _fn(backend: str, interpret: bool):
    options = {"backend": backend, **({"interpret": True} if interpret and backend == "triton" else {})}
    return jax.jit(lambda q, k, v, m: local_attention(q, k, v, m, **options))


def judge(out, lse, ref_out, ref_lse) -> dict:
    out, lse = np.asarray(out, np.float32), np.asarray(lse, np.float32)
    finite = bool(np.isfinite(out).all() and np.isfinite(lse).all())
    lse_err = float(np.abs(lse - ref_lse).max()) if finite else math.inf
    rel_l2 = float(np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)) if finite else math.inf
    ok = finite and lse_err <= LSE_BOUND and rel_l2 <= REL_L2_BOUND
    return {"finite": finite, "lse_err": lse_err, "rel_l2": rel_l2, "correct": ok}


def run_case(case: Case, platform: str, ceiling_tflops: float | None, dry: bool, emit) -> None:
    """One row per backend, through ``emit``: unavailable / failed (untimed) / timed."""
    q, k, v, mask = inputs(case)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    ref_out, ref_lse = jax.jit(lambda q, k, v, m: local_attention(q, k, v, m, backend="xla"))(*f32, mask)
    ref_out, ref_lse = np.asarray(ref_out), np.asarray(ref_lse)
    args = tuple(jnp.asarray(x) for x in (q, k, v, mask))
    nan_args = tuple(jnp.full_like(x, jnp.nan) for x in args[:3]) + (args[3],)
    shape = {"tokens": int(mask.shape[1]), "valid_tokens": int(mask.sum()), "heads": case.heads}
    for backend in BACKENDS:
        row = {"part": "attention", "case": case.name, "backend": backend, "shape": shape}
        choice = kernels.backend_for(platform, jnp.bfloat16, q.shape, requested=backend, interpret=dry)
        if choice.backend != backend:
            emit({**row, "status": "unavailable", "reason": choice.reason})
            continue
        try:
            fn = _fn(backend, dry)
            jax.block_until_ready(fn(*nan_args))  # poison the buffers the judged call is handed
            row.update(judge(*fn(*args), ref_out, ref_lse))
            if not row["correct"]:
                emit({**row, "status": "failed"})
                continue
            seconds = batched_median(fn, args, batch=20 if not dry else 2, batches=7 if not dry else 2)
        except Exception as e:  # noqa: BLE001 - a kernel that crashes is a failed row, the session goes on
            emit({**row, "status": "failed", "error": f"{type(e).__name__}: {str(e)[:400]}"})
            continue
        tflops = case.flops() / seconds / 1e12
        row.update(status="ok", seconds=seconds, tflops=tflops)
        row["pct_of_matmul_ceiling"] = 100.0 * tflops / ceiling_tflops if ceiling_tflops else None
        if case.chip_filling and backend == "cudnn":
            row["target_tflops"] = TARGET_CUDNN_TFLOPS
            row["meets_target"] = tflops >= TARGET_CUDNN_TFLOPS
        emit(row)
