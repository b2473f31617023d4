"""Attention on one device: the entry point every strategy calls; returns the output and the LSE.

``local_attention`` checks shapes and dispatches to a kernel backend (``jaxdit.parallel.kernels``):
the plain-XLA blockwise kernel (the default on CPUs and for float32), cuDNN's fused attention, a Pallas
Triton kernel or TPU splash attention, chosen at trace time from ``backend`` ("auto" by default), the
platform, the dtype and the head dimension. Every backend returns the log-sum-exp in fp32, natural log,
so partial results computed on different key blocks (Ring attention) merge exactly with
:func:`merge_partials`, whatever computed them.

Shapes: q [B, Tq, H, D], k/v [B, Tk, H, D] (einsum letters b q/k h d); key_valid [B, Tk] bool.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxdit.parallel.kernels import choose, cudnn, splash, triton, xla
from jaxdit.parallel.kernels.xla import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q

__all__ = [
    "DEFAULT_BLOCK_K",
    "DEFAULT_BLOCK_Q",
    "local_attention",
    "merge_partials",
    "reference_attention",
]


def local_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_valid: jax.Array | None = None,
    *,
    scale: float | None = None,
    block_k: int = DEFAULT_BLOCK_K,
    block_q: int = DEFAULT_BLOCK_Q,
    out_dtype=None,
    backend: str = "auto",
    interpret: bool = False,
    platform: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of q over k/v, masking keys where ``key_valid`` is False.

    Returns ``(out [B, Tq, H, D] in out_dtype (default q's), lse [B, Tq, H] fp32)``; Ring attention asks
    for fp32 partial outputs so that merging them rounds once, at the end. A query whose keys are all masked
    gets out = 0 and lse = -inf, which is what merging partial results needs.

    ``backend``: auto / xla / cudnn / triton / splash (``jaxdit.parallel.kernels``); one that cannot
    serve this platform, dtype or head dimension falls back with one warning. ``block_q``/``block_k`` are
    the XLA kernel's tiles (the fused kernels pick their own). ``interpret`` runs the Pallas kernels
    (triton, splash) in Pallas' interpreter on any platform; ``platform`` is the one the program is
    lowered for (default: jax's default backend).
    """
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"local_attention expects q [B,Tq,H,D], k/v [B,Tk,H,D]; got {q.shape}, {k.shape}, {v.shape}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    name = choose(backend, platform, q.dtype, q.shape, k.shape, interpret)
    if name == "xla":
        out, lse = xla.attention(q, k, v, key_valid, scale=scale, block_k=block_k, block_q=block_q)
        return out.astype(out_dtype or q.dtype), lse
    if name == "cudnn":
        return cudnn.attention(q, k, v, key_valid, scale=scale, out_dtype=out_dtype)
    if name == "triton":
        return triton.attention(q, k, v, key_valid, scale=scale, out_dtype=out_dtype, interpret=interpret)
    return splash.attention(q, k, v, key_valid, scale=scale, out_dtype=out_dtype, interpret=interpret)


def _safe(m: jax.Array) -> jax.Array:
    """-inf (a row with no valid key) -> 0, so exp(x - m) never evaluates inf - inf."""
    return jnp.where(jnp.isfinite(m), m, 0.0)


def merge_partials(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Combine attention over two disjoint key sets from their outputs and LSEs, in fp32.

    softmax over (A u B) = w_a softmax_A + w_b softmax_B with w_x = exp(lse_x - lse), lse = logaddexp.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    base = _safe(lse)
    w_a = jnp.exp(lse_a - base)[..., None]
    w_b = jnp.exp(lse_b - base)[..., None]
    out = w_a * out_a.astype(jnp.float32) + w_b * out_b.astype(jnp.float32)
    return out, lse


def reference_attention(q, k, v, key_valid=None, scale=None):
    """Plain softmax attention (full score matrix), the ground truth in tests."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if key_valid is not None:
        s = jnp.where(key_valid[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(q.dtype)
