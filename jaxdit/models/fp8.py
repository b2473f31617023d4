"""FP8 (``float8_e4m3fn``) weights and matmuls for the models' linear layers.

A quantized kernel ``W [in, out]`` is stored as ``q = round(W / s)`` in FP8 with one fp32 scale ``s`` per
output channel, so ``x @ W = (x @ q) * s``: the scale is applied to the matmul's fp32 output, never to a
dequantized copy of the weight. Two ways to run the matmul (:data:`MODES`):

- ``"weight"`` (weight-only): ``q`` is converted to the compute dtype inside the layer and the matmul runs
  there (bf16 on GPU). Half the weight memory of bf16 on every platform; the activations are untouched.
- ``"matmul"``: the activations are quantized too, at run time, with one scale per token (the largest
  magnitude of that token's features over 448), and the dot takes two FP8 operands with fp32
  accumulation, which XLA's GPU compiler runs as an FP8 GEMM on cards that have one (compute capability
  8.9 and later). Per-token rather than per-tensor activation scales keep the result independent of how
  the sequence is sharded: a device scales only its own tokens, so every strategy computes what one
  device computes. The one exception is a row-parallel layer (input features split over ``tensor``),
  whose per-token maximum is taken over the tensor axis first.

Per-channel weight scales cost nothing in either mode (they multiply the output), and they keep one FP8
checkpoint good for both.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes

__all__ = ["E4M3", "E4M3_MAX", "MODES", "choose_mode", "fp8_linear", "is_fp8", "quantize_kernel"]

E4M3 = jnp.float8_e4m3fn
#: The largest finite float8_e4m3fn value (448): a scale maps each channel's largest magnitude onto it.
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
MODES = ("weight", "matmul")


#: The first NVIDIA compute capability with FP8 tensor cores (Ada; Hopper is 9.0).
FP8_COMPUTE_CAPABILITY = (8, 9)


def _gpu_without_fp8(device) -> str | None:
    """The compute capability of a GPU below FP8's, or None (an FP8 GPU, or not a GPU: the CPU emulates)."""
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None:
        return None
    major, minor = (int(part) for part in str(capability).split(".")[:2])
    return None if (major, minor) >= FP8_COMPUTE_CAPABILITY else str(capability)


def choose_mode(requested: str | None, devices) -> str:
    """The FP8 mode a run uses, decided before anything compiles: ``requested`` where the devices can
    run it; FP8 matmuls by default on GPUs that have them, weight-only elsewhere; a requested ``matmul``
    on a GPU without FP8 tensor cores falls back to ``weight`` with one warning."""
    if requested is not None and requested not in MODES:
        raise ValueError(f"fp8 mode {requested!r}: expected one of {', '.join(MODES)}")
    devices = list(devices)
    lacking = next((c for c in map(_gpu_without_fp8, devices) if c is not None), None)
    if requested == "matmul" and lacking is not None:
        warnings.warn(
            f"FP8 matmuls need compute capability 8.9 or later; this GPU is {lacking}: running FP8 "
            "weight-only instead (weights dequantized into bf16 matmuls)",
            stacklevel=2,
        )
        return "weight"
    if requested is not None:
        return requested
    gpus = all(d.platform == "gpu" for d in devices)
    return "matmul" if gpus and lacking is None else "weight"


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _scale_for(amax: jax.Array) -> jax.Array:
    # An all-zero channel keeps scale 1 (its FP8 values are 0 either way) rather than dividing by 0.
    return jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)


def _to_e4m3(x: jax.Array) -> jax.Array:
    # |x| <= 448 by construction; the clip only guards against rounding at the edge.
    return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def quantize_kernel(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``kernel [..., in, out]`` -> (FP8 values [..., in, out], fp32 scale per output channel [..., out]).

    Leading axes (a block stack's layer axis) are kept: each layer has its own scales."""
    w = kernel.astype(jnp.float32)
    scale = _scale_for(jnp.abs(w).max(axis=-2))
    return _to_e4m3(w / scale[..., None, :]), scale


def fp8_linear(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    *,
    mode: str,
    compute_dtype,
    token_max: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """``x @ (q * scale)`` in fp32 (before any bias): ``x [..., in]``, ``q [in, out]`` FP8, ``scale [out]``.

    ``token_max``: for ``"matmul"`` on a row-parallel layer, the maximum over the tensor axis of each
    token's local maximum (so every tensor shard scales a token alike)."""
    if mode == "weight":
        y = jnp.einsum(
            "...i,io->...o",
            x.astype(compute_dtype),
            q.astype(compute_dtype),
            preferred_element_type=jnp.float32,
        )
        return y * scale
    if mode != "matmul":
        raise ValueError(f"fp8 mode {mode!r}: expected one of {', '.join(MODES)}")
    xf = x.astype(jnp.float32)
    amax = jnp.abs(xf).max(axis=-1, keepdims=True)
    if token_max is not None:
        amax = token_max(amax)
    x_scale = _scale_for(amax)
    y = jnp.einsum("...i,io->...o", _to_e4m3(xf / x_scale), q, preferred_element_type=jnp.float32)
    return y * x_scale * scale
