"""Attention on one device, blockwise over keys with an online softmax; returns the output and the LSE.

Memory grows linearly with the sequence: scores are materialised one [q_block, k_block] tile at a time
(FlashAttention's recurrence, arXiv 2205.14135, written in plain XLA so it runs on every backend). Wan-14B
at 720p puts 75,600 tokens on every device after Ulysses' all-to-all; a full score matrix there would be
over 100 GB. The log-sum-exp is returned in fp32 so that partial results computed on different key
blocks (Ring attention) merge exactly.

Shapes: q [B, Tq, H, D], k/v [B, Tk, H, D] (einsum letters b q/k h d); key_valid [B, Tk] bool.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

#: Default tile sizes. The score tile is B*H*block_q*block_k fp32 values; 1024 x 4096 keeps it at
#: 16 MB per head and batch element while giving matmuls large enough to run near peak.
DEFAULT_BLOCK_K = 1024
DEFAULT_BLOCK_Q = 4096


def _safe(m: jax.Array) -> jax.Array:
    """-inf (a row with no valid key yet) -> 0, so exp(x - m) never evaluates inf - inf."""
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _pad_axis(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _attend_key_blocks(q, k, v, key_valid, scale, block_k):
    """Online softmax over key blocks for one query block. Returns out (fp32) and lse (fp32)."""
    b, tq, h, d = q.shape
    tk = k.shape[1]
    if key_valid is None:
        key_valid = jnp.ones((b, tk), dtype=bool)
    nblocks = max(1, math.ceil(tk / block_k))
    block_k = math.ceil(tk / nblocks)  # even blocks: the last one is not mostly padding
    k = _pad_axis(k, 1, block_k)
    v = _pad_axis(v, 1, block_k)
    key_valid = _pad_axis(key_valid, 1, block_k, value=False)

    def tile(carry, kv):
        m, l, acc = carry  # running max [b h q], running sum [b h q], output [b q h d], all fp32
        kb, vb, valid = kv
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kb, preferred_element_type=jnp.float32) * scale
        s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - _safe(m_new)[..., None])
        correction = jnp.exp(m - _safe(m_new))
        l_new = l * correction + p.sum(axis=-1)
        pv = jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
        acc_new = acc * jnp.transpose(correction, (0, 2, 1))[..., None] + pv
        return (m_new, l_new, acc_new), None

    init = (
        jnp.full((b, h, tq), -jnp.inf, jnp.float32),
        jnp.zeros((b, h, tq), jnp.float32),
        jnp.zeros((b, tq, h, d), jnp.float32),
    )
    if nblocks == 1:
        (m, l, acc), _ = tile(init, (k, v, key_valid))
    else:
        blocks = (
            k.reshape(b, nblocks, block_k, h, d).swapaxes(0, 1),
            v.reshape(b, nblocks, block_k, h, d).swapaxes(0, 1),
            key_valid.reshape(b, nblocks, block_k).swapaxes(0, 1),
        )
        (m, l, acc), _ = lax.scan(tile, init, blocks)
    lse = jnp.where(l > 0, _safe(m) + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)  # [b h q]
    inv_l = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    out = acc * jnp.transpose(inv_l, (0, 2, 1))[..., None]
    return out, jnp.transpose(lse, (0, 2, 1))


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
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of q over k/v, masking keys where ``key_valid`` is False.

    Returns ``(out [B, Tq, H, D] in out_dtype (default q's), lse [B, Tq, H] fp32)``; Ring attention asks
    for fp32 partial outputs so that merging them rounds once, at the end. A query whose keys are all masked
    gets out = 0 and lse = -inf, which is what merging partial results needs.
    """
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"local_attention expects q [B,Tq,H,D], k/v [B,Tk,H,D]; got {q.shape}, {k.shape}, {v.shape}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, tq, h, d = q.shape
    if tq <= block_q:
        out, lse = _attend_key_blocks(q, k, v, key_valid, scale, block_k)
    else:
        nq = math.ceil(tq / block_q)
        bq = math.ceil(tq / nq)
        qp = _pad_axis(q, 1, bq).reshape(b, nq, bq, h, d).swapaxes(0, 1)
        out, lse = lax.map(lambda qb: _attend_key_blocks(qb, k, v, key_valid, scale, block_k), qp)
        out = out.swapaxes(0, 1).reshape(b, nq * bq, h, d)[:, :tq]
        lse = lse.swapaxes(0, 1).reshape(b, nq * bq, h)[:, :tq]
    return out.astype(out_dtype or q.dtype), lse


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
