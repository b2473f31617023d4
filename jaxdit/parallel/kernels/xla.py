"""The portable kernel: blockwise attention over keys with an online softmax, in plain XLA.

Memory grows linearly with the sequence: scores are materialised one [q_block, k_block] tile at a time
(FlashAttention's recurrence, arXiv 2205.14135, written in plain XLA so it runs on every backend). Wan-14B
at 720p puts 75,600 tokens on every device after Ulysses' all-to-all; a full score matrix there would be
over 100 GB. The log-sum-exp is returned in fp32 so that partial results computed on different key
blocks (Ring attention) merge exactly. It is the CPU default and the reference the fused kernels are
held to.

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


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_valid: jax.Array | None,
    *,
    scale: float,
    block_k: int = DEFAULT_BLOCK_K,
    block_q: int = DEFAULT_BLOCK_Q,
) -> tuple[jax.Array, jax.Array]:
    """Blockwise attention; returns (out [B, Tq, H, D] fp32, lse [B, Tq, H] fp32).

    Queries are processed ``block_q`` at a time (``lax.map``), keys ``block_k`` at a time (``lax.scan``),
    both in even blocks (the last one is not mostly padding).
    """
    b, tq, h, d = q.shape
    if tq <= block_q:
        return _attend_key_blocks(q, k, v, key_valid, scale, block_k)
    nq = math.ceil(tq / block_q)
    bq = math.ceil(tq / nq)
    qp = _pad_axis(q, 1, bq).reshape(b, nq, bq, h, d).swapaxes(0, 1)
    out, lse = lax.map(lambda qb: _attend_key_blocks(qb, k, v, key_valid, scale, block_k), qp)
    out = out.swapaxes(0, 1).reshape(b, nq * bq, h, d)[:, :tq]
    lse = lse.swapaxes(0, 1).reshape(b, nq * bq, h)[:, :tq]
    return out, lse
