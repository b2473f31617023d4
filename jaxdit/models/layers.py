"""Layers shared by the model families: linear layers with logical axes, norms, embeddings, RoPE.

Shape letters: B batch, L tokens, H heads, D head_dim, E embed (hidden), F MLP hidden.
Precision policy: weights and matmuls in the model's dtype (bf16 on GPU) with fp32 accumulation;
norms, RoPE, AdaLN modulation and softmax statistics in fp32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.parallel.context import ShardContext


def param(rngs: nnx.Rngs, shape, axes, dtype, init="normal", scale=0.02) -> nnx.Param:
    """A parameter carrying its logical axis names (one per dimension)."""
    if len(axes) != len(shape):
        raise ValueError(f"axes {axes} do not match shape {shape}")
    if init == "zeros":
        value = jnp.zeros(shape, dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


class Linear(nnx.Module):
    """y = x @ W + b with W [in, out]; ``axes`` = logical names of (in, out).

    ``row_parallel``: the input features are split over tensor (axes[0] is "heads" or "mlp"), so each
    device holds a partial sum; it is all-reduced (``ctx.sum_tensor_parallel``) before the bias.
    """

    def __init__(self, d_in, d_out, axes, *, rngs, bias=True, dtype=jnp.float32, row_parallel=False):
        self.kernel = param(rngs, (d_in, d_out), axes, dtype)
        self.bias = param(rngs, (d_out,), (axes[1],), dtype, init="zeros") if bias else None
        self.row_parallel = row_parallel

    def __call__(self, x: jax.Array, ctx: ShardContext | None = None) -> jax.Array:
        kernel = self.kernel[...]
        y = jnp.einsum("...i,io->...o", x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
        if self.row_parallel:
            if ctx is None:
                raise ValueError("a row-parallel Linear needs the shard context to all-reduce")
            y = ctx.sum_tensor_parallel(y)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(kernel.dtype)


def layer_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Non-affine LayerNorm over the last axis, computed in fp32 (returns fp32)."""
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps)


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over the last axis in fp32 (returns fp32)."""
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps)
    return y if scale is None else y * scale.astype(jnp.float32)


def gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


def timestep_embedding(t: jax.Array, dim: int, *, max_period: float = 10000.0) -> jax.Array:
    """Sinusoidal embedding, cos half first: [B] -> [B, dim] fp32 (FLUX and Wan both use this order)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def rope_angles(positions: jax.Array, axes_dim, theta: float = 10000.0) -> jax.Array:
    """Per-token rotation angles for multi-axis RoPE: positions [..., n_axes] -> [..., sum(axes_dim)/2].

    Axis i owns axes_dim[i] head dims (axes_dim[i]/2 rotated pairs) with frequencies theta^(-2j/d_i).
    Computed in fp32 from positions that are small integers, so every shard computes its own tokens'
    angles exactly as the unsharded model would.
    """
    parts = []
    for i, d in enumerate(axes_dim):
        omega = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
        parts.append(positions[..., i : i + 1].astype(jnp.float32) * omega)
    return jnp.concatenate(parts, axis=-1)


def apply_rope(x: jax.Array, angles: jax.Array) -> jax.Array:
    """Rotate interleaved pairs (x[2j], x[2j+1]) by angles[j]; x [B, L, H, D], angles [B, L, D/2]; fp32."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = jnp.stack([cos * x0 - sin * x1, sin * x0 + cos * x1], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)
