"""Pallas (Triton) attention for GPUs: FlashAttention-2's forward pass with a per-key mask.

FlashAttention-2 (Dao, arXiv 2307.08691): one program per (query block, batch element, head) keeps its
query tile, running max, running sum and fp32 accumulator on chip and walks over the key blocks; the
scores never reach memory. The exponentials are taken in base 2 (``exp2`` is the GPU's native one; the
scores are multiplied by log2(e) once) and the log-sum-exp is converted back to natural log on the
way out, so it merges with the other backends' results.

Why a kernel of our own rather than jax's ``jax.experimental.pallas.ops.gpu.attention.mha``: ``mha``
takes padding as ONE ``segment_ids`` array that serves both queries and keys, so query i always belongs
to the class of key i. That is exact for self-attention whose padding sits at the same positions for
queries and keys, but not for Ring attention (the K/V block of another shard has its padding elsewhere),
for the shard-major layout's padding in the middle of a shard once it meets another shard's keys, nor
for cross-attention (Tq != Tk). This kernel takes the key mask on its own ([B, Tk]), so every query
attends to exactly the valid keys, for any Tq and Tk.

Lengths are padded to the block sizes (padded keys are masked, padded queries dropped) and the head
dimension to a power of two of at least 16 (zero columns change no score and produce zero output
columns), which Triton's block shapes need. ``interpret=True`` runs the same kernel in Pallas' interpreter
on any backend (the tests do, on CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxdit.parallel.kernels.contract import clear_empty_rows, next_power_of_two, pad_axis, round_up

#: Tile sizes on a GPU (FlashAttention-2's forward defaults for head_dim 128).
BLOCK_Q = 128
BLOCK_K = 64
#: Largest head dimension served: the query tile, the accumulator and one K and V tile live on chip.
MAX_HEAD_DIM = 256
#: Smallest block Triton's dot takes.
MIN_BLOCK = 16
#: A masked score: finite, so a row with no valid key yet never evaluates inf - inf.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2_E = math.log2(math.e)
_LN_2 = math.log(2.0)
#: dot_general dimension numbers: q @ k^T (contract head dims) and p @ v.
_QK = (((1,), (1,)), ((), ()))
_PV = (((1,), (0,)), ((), ()))


def _forward(q_ref, k_ref, v_ref, valid_ref, out_ref, lse_ref, *, scale_log2: float, block_k: int):
    """One query block of one (batch element, head): q_ref [bq, D], k_ref/v_ref [Lk, D], valid_ref [Lk]."""
    q = q_ref[...]
    block_q = q.shape[0]

    def over_key_block(j, carry):
        acc, row_max, row_sum = carry
        keys = pl.ds(j * block_k, block_k)
        s = lax.dot_general(q, k_ref[keys, :], _QK, preferred_element_type=jnp.float32) * scale_log2
        s = jnp.where(valid_ref[keys][None, :] != 0, s, _MASKED)  # [bq, bk] fp32, base-2 units
        new_max = jnp.maximum(row_max, s.max(axis=1))
        rescale = jnp.exp2(row_max - new_max)
        p = jnp.exp2(s - new_max[:, None])
        row_sum = row_sum * rescale + p.sum(axis=1)
        v = v_ref[keys, :]
        acc = acc * rescale[:, None] + lax.dot_general(
            p.astype(v.dtype), v, _PV, preferred_element_type=jnp.float32
        )
        return acc, new_max, row_sum

    init = (
        jnp.zeros((block_q, q.shape[1]), jnp.float32),
        jnp.full((block_q,), _MASKED, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, row_max, row_sum = lax.fori_loop(0, k_ref.shape[0] // block_k, over_key_block, init)
    out_ref[...] = (acc / row_sum[:, None]).astype(out_ref.dtype)
    lse_ref[...] = (row_max + jnp.log2(row_sum)) * _LN_2  # base 2 -> natural log


def block_sizes(tq: int, tk: int, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> tuple[int, int]:
    """The tiles used for these lengths: the defaults, shrunk (to a power of two >= 16) for short ones."""
    fit = lambda n, block: max(MIN_BLOCK, min(block, next_power_of_two(n)))
    return fit(tq, block_q), fit(tk, block_k)


def unsupported(dtype, head_dim: int) -> str | None:
    """Why this kernel cannot serve the dtype / head dimension, or None."""
    if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return f"the Triton kernel takes float32/bfloat16/float16, not {jnp.dtype(dtype).name}"
    if head_dim > MAX_HEAD_DIM:
        return f"the Triton kernel takes head_dim <= {MAX_HEAD_DIM}, not {head_dim}"
    return None


def missing() -> str | None:
    """Why this jax cannot lower the kernel for a GPU (no Pallas Triton backend), or None."""
    try:
        from jax.experimental.pallas import triton as plgpu

        plgpu.CompilerParams  # noqa: B018 - the one name the kernel takes from it
    except (ImportError, AttributeError) as e:
        return f"jax {jax.__version__} has no Pallas Triton backend ({e})"
    return None


@functools.partial(jax.jit, static_argnames=("scale", "out_dtype", "block_q", "block_k", "interpret"))
def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_valid: jax.Array | None,
    *,
    scale: float,
    out_dtype=None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """q [B, Tq, H, D], k/v [B, Tk, H, D], key_valid [B, Tk] or None -> (out [B, Tq, H, D], lse fp32).

    ``out`` is in ``out_dtype`` (default q's): Ring asks for fp32 partial outputs, which the kernel
    writes straight from its fp32 accumulator.
    """
    b, tq, h, d = q.shape
    tk = k.shape[1]
    bq, bk = block_sizes(tq, tk, block_q, block_k)
    lq, lk = round_up(tq, bq), round_up(tk, bk)
    dp = max(MIN_BLOCK, next_power_of_two(d))
    valid = jnp.ones((b, tk), jnp.int32) if key_valid is None else key_valid.astype(jnp.int32)
    valid = pad_axis(valid, 1, lk)  # padded keys are masked
    q = pad_axis(pad_axis(q, 1, lq), 3, dp)
    k = pad_axis(pad_axis(k, 1, lk), 3, dp)
    v = pad_axis(pad_axis(v, 1, lk), 3, dp)
    out_dtype = jnp.dtype(out_dtype or q.dtype)

    kernel = functools.partial(_forward, scale_log2=scale * _LOG2_E, block_k=bk)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        compiler_params = plgpu.CompilerParams(num_warps=4 if dp <= 64 else 8, num_stages=2)
    out, lse = pl.pallas_call(
        kernel,
        grid=(lq // bq, b, h),
        in_specs=[
            pl.BlockSpec((None, bq, None, dp), lambda i, j, n: (j, i, n, 0)),
            pl.BlockSpec((None, lk, None, dp), lambda i, j, n: (j, 0, n, 0)),
            pl.BlockSpec((None, lk, None, dp), lambda i, j, n: (j, 0, n, 0)),
            pl.BlockSpec((None, lk), lambda i, j, n: (j, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, dp), lambda i, j, n: (j, i, n, 0)),
            pl.BlockSpec((None, None, bq), lambda i, j, n: (j, n, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, lq, h, dp), out_dtype),
            jax.ShapeDtypeStruct((b, h, lq), jnp.float32),
        ],
        compiler_params=compiler_params,
        interpret=interpret,
        name="jaxdit_flash_attention_fwd",
    )(q, k, v, valid)
    out = out[:, :tq, :, :d]
    lse = jnp.transpose(lse[:, :, :tq], (0, 2, 1))
    return clear_empty_rows(out, lse, key_valid)
