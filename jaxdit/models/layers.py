"""Layers shared by the model families: linear layers with logical axes, norms, embeddings, RoPE.

Shape letters: B batch, L tokens, H heads, D head_dim, E embed (hidden), F MLP hidden.
Precision policy: weights and matmuls in the model's dtype (bf16 on GPU) with fp32 accumulation;
norms, RoPE, AdaLN modulation and softmax statistics in fp32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdit.models import fp8
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

    FP8 (``jaxdit.models.quantize``): the kernel is stored as ``float8_e4m3fn`` with ``kernel_scale``
    (fp32, one per output channel) and ``fp8_mode`` says how the matmul runs (``jaxdit.models.fp8``); the
    layer computes and returns ``compute_dtype``, the dtype the kernel had before.
    """

    def __init__(self, d_in, d_out, axes, *, rngs, bias=True, dtype=jnp.float32, row_parallel=False):
        self.kernel = param(rngs, (d_in, d_out), axes, dtype)
        self.bias = param(rngs, (d_out,), (axes[1],), dtype, init="zeros") if bias else None
        self.row_parallel = row_parallel
        self.kernel_scale: nnx.Param | None = nnx.data(None)  # data: quantize_model may set it
        self.fp8_mode: str | None = None
        self.compute_dtype = None

    @property
    def dtype(self):
        """The dtype the layer computes in and returns (its kernel's, or the one before FP8)."""
        return self.kernel.dtype if self.compute_dtype is None else self.compute_dtype

    def partial_sum(self, x: jax.Array, ctx: ShardContext | None = None) -> jax.Array:
        """x @ W in fp32, without the bias and, for a row-parallel layer, without the all-reduce: one term
        of a row-parallel sum (``ctx`` is needed then only by FP8 matmuls, to scale tokens alike)."""
        kernel = self.kernel[...]
        if self.kernel_scale is None:
            return jnp.einsum(
                "...i,io->...o", x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32
            )
        token_max = None
        # Input features over heads or MLP units are split over tensor (whether the caller all-reduces
        # through ``row_parallel`` or adds partial sums itself): FP8 matmuls scale a token by its maximum
        # over all shards, so each shard quantizes it alike.
        if self.row_parallel or self.kernel.logical_axes[-2] in ("heads", "mlp"):
            if ctx is None:
                raise ValueError("an FP8 row-parallel Linear needs the shard context to scale its input")
            token_max = ctx.max_tensor_parallel
        return fp8.fp8_linear(
            x,
            kernel,
            self.kernel_scale[...],
            mode=self.fp8_mode,
            compute_dtype=self.dtype,
            token_max=token_max,
        )

    def __call__(self, x: jax.Array, ctx: ShardContext | None = None) -> jax.Array:
        if self.row_parallel and ctx is None:
            raise ValueError("a row-parallel Linear needs the shard context to all-reduce")
        y = self.partial_sum(x, ctx)
        if self.row_parallel:
            y = ctx.sum_tensor_parallel(y)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)


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


def sinusoid_frequencies(half: int, max_period: float) -> np.ndarray:
    """``max_period ** (-k / half)`` in fp32, the exponents rounded as diffusers' fp32 arithmetic rounds
    them and the exponential correctly rounded on the host. The angles reach t x 1000 rad, where one ulp
    of a frequency moves a feature by up to ~1e-4; XLA's CPU exp misses the correctly rounded value on
    about 1 in 8 of these frequencies, PyTorch's on about 1 in 64, so host constants track diffusers best."""
    exponent = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32) / np.float32(half)
    return np.exp(exponent.astype(np.float64)).astype(np.float32)


def timestep_embedding(t: jax.Array, dim: int, *, max_period: float = 10000.0) -> jax.Array:
    """Sinusoidal embedding, cos half first: [B] -> [B, dim] fp32 (FLUX and Wan both use this order)."""
    half = dim // 2
    freqs = jnp.asarray(sinusoid_frequencies(half, max_period))
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
