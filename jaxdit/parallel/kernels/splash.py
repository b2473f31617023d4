"""TPU splash attention (jax's ``jax.experimental.pallas.ops.tpu.splash_attention``) behind the contract.

Splash attention is a block-sparse FlashAttention kernel for TPUs written in Pallas (Mosaic). With
``save_residuals=True`` it returns the log-sum-exp of each query in fp32, natural log, which is what Ring
attention merges. It works on one batch element at a time (q [H, T, D]), so batches are vmapped; it has
no scale argument, so q is scaled first; and it takes padding as separate query and key segment ids:
every query is in segment 0, a valid key in segment 0 and a masked (or block-padding) key in segment 1,
so any key mask is exact. Lengths are padded to the block sizes (128, a TPU lane row). ``interpret=True``
runs it in Pallas' interpreter on any backend (the tests do, on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxdit.parallel.kernels.contract import clear_empty_rows, pad_axis, round_up

#: Query and key tile on a TPU; key tiles must be a multiple of the 128 lanes.
BLOCK = 128


def unsupported(dtype, head_dim: int) -> str | None:
    """Why splash cannot serve the dtype / head dimension, or None."""
    if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):
        return f"splash attention takes float32/bfloat16, not {jnp.dtype(dtype).name}"
    return None


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, lq: int, lk: int, interpret: bool):
    """The splash kernel for [heads, lq] queries over [heads, lk] keys, no static mask (padding is
    carried by segment ids). Built once per shape: building processes the mask on the host. Its block
    tables are made concrete (not traced), since the cached kernel outlives the trace that built it."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([sa.FullMask((lq, lk)) for _ in range(heads)])
    blocks = sa.BlockSizes(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK)
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mha(
            mask, head_shards=1, q_seq_shards=1, block_sizes=blocks, save_residuals=True, interpret=interpret
        )


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_valid: jax.Array | None,
    *,
    scale: float,
    out_dtype=None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """q [B, Tq, H, D], k/v [B, Tk, H, D], key_valid [B, Tk] or None -> (out [B, Tq, H, D], lse fp32)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    b, tq, h, d = q.shape
    tk = k.shape[1]
    lq, lk = round_up(tq, BLOCK), round_up(tk, BLOCK)
    valid = jnp.ones((b, tk), bool) if key_valid is None else key_valid
    kv_segment = pad_axis(jnp.where(valid, 0, 1).astype(jnp.int32), 1, lk, value=1)
    q_segment = jnp.zeros((lq,), jnp.int32)
    heads_major = lambda x, n: jnp.transpose(pad_axis(x, 1, n), (0, 2, 1, 3))  # [B, H, L, D]
    kernel = _kernel(h, lq, lk, interpret)

    def one(qb, kb, vb, kv_ids):
        return kernel(qb, kb, vb, segment_ids=SegmentIds(q=q_segment, kv=kv_ids))

    scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)
    out, (lse,) = jax.vmap(one)(heads_major(scaled, lq), heads_major(k, lk), heads_major(v, lk), kv_segment)
    out = jnp.transpose(out[:, :, :tq], (0, 2, 1, 3)).astype(out_dtype or q.dtype)
    lse = jnp.transpose(lse[:, :, :tq], (0, 2, 1))
    return clear_empty_rows(out, lse, key_valid)
