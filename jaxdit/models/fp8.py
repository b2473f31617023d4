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

from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes

__all__ = ["E4M3", "E4M3_MAX", "MODES", "fp8_linear", "is_fp8", "quantize_kernel"]

E4M3 = jnp.float8_e4m3fn
#: The largest finite float8_e4m3fn value (448): a scale maps each channel's largest magnitude onto it.
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
MODES = ("weight", "matmul")


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
