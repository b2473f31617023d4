"""Wan's layers, as the local view of one sequence shard: self- and cross-attention, the block, the
I2V image embedding, and the modulation and norm helpers they share.

Follows ``wan/modules/model.py`` (``WanSelfAttention``, ``WanT2VCrossAttention`` /
``WanI2VCrossAttention``, ``WanAttentionBlock``, ``MLPProj``; Wan-Video/Wan2.1) and diffusers'
``WanTransformerBlock`` and ``WanImageEmbedding`` (``models/transformers/transformer_wan.py``). The
parallel plan they implement (sequence-parallel self-attention through ``ctx.attention``, local
cross-attention, Megatron tensor parallelism with q/k RMSNorm across all heads) and their precision are
described in ``models/wan.py``, the transformer that stacks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdit.models.layers import Linear, apply_rope, gelu_tanh, layer_norm, param
from jaxdit.models.wan_config import WanConfig
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.local_attention import local_attention

__all__ = [
    "WanBlock",
    "WanCrossAttention",
    "WanImageEmbedding",
    "WanSelfAttention",
    "fp32_linear",
    "token_modulation",
]


def fp32_linear(layer: Linear, x: jax.Array) -> jax.Array:
    """A Linear evaluated entirely in fp32 (the time embedding and modulation path)."""
    y = jnp.einsum("...i,io->...o", x.astype(jnp.float32), layer.kernel[...].astype(jnp.float32))
    return y if layer.bias is None else y + layer.bias[...].astype(jnp.float32)


def _affine_layer_norm(x: jax.Array, weight: nnx.Param, bias: nnx.Param, eps: float) -> jax.Array:
    return layer_norm(x, eps) * weight[...].astype(jnp.float32) + bias[...].astype(jnp.float32)


def _rms_norm_across_heads(
    xs: Sequence[jax.Array], scales: Sequence[nnx.Param], full_dim: int, eps: float, ctx: ShardContext
) -> list[jax.Array]:
    """RMSNorm over the full hidden size (all heads) of several [B, L_i, E_local] arrays, in fp32.

    Under tensor parallelism each device holds E/tensor features; the per-token sums of squares of all
    the arrays are joined and all-reduced once (``ctx.sum_tensor_parallel``), so one small collective
    serves them all.
    """
    xs = [x.astype(jnp.float32) for x in xs]
    partial = [jnp.square(x).sum(-1) for x in xs]  # [B, L_i]
    total = ctx.sum_tensor_parallel(jnp.concatenate(partial, axis=1) if len(xs) > 1 else partial[0])
    bounds = np.cumsum([x.shape[1] for x in xs])[:-1].tolist()
    totals = jnp.split(total, bounds, axis=1) if len(xs) > 1 else [total]
    return [
        x * jax.lax.rsqrt(t[..., None] / full_dim + eps) * s[...].astype(jnp.float32)
        for x, t, s in zip(xs, totals, scales, strict=True)
    ]


def _heads(x: jax.Array, head_dim: int) -> jax.Array:
    """[B, L, E_local] -> [B, L, H_local, D] (features are head-major: E = H x D)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


def _norm_weight(rngs: nnx.Rngs, dim: int, axis: str | None) -> nnx.Param:
    return param(rngs, (dim,), (axis,), jnp.float32, init="ones")


def token_modulation(
    time_vectors: jax.Array, table: jax.Array, token_time: jax.Array | None
) -> list[jax.Array]:
    """A block's (or the head's) modulation vectors: its learned ``table`` [k, E] plus the time vectors.

    One timestep per sample: ``time_vectors`` [B, k, E] -> k arrays [B, 1, E]. Per-token timesteps:
    ``time_vectors`` [2, B, k, E] (those of t and of 0) and ``token_time`` [1, N, 1] bool (True: the token
    sees t) -> k arrays [B, N, E], each token's row taken from its own timestep's vectors (a select, so
    exactly the numbers a per-token embedding gives; XLA fuses it into the elementwise consumers).
    """
    if token_time is None:
        mod = time_vectors + table[None]
        return [mod[:, i, None, :] for i in range(mod.shape[1])]
    mod = time_vectors + table[None, None]
    return [jnp.where(token_time, mod[0, :, i, None, :], mod[1, :, i, None, :]) for i in range(mod.shape[2])]


class WanSelfAttention(nnx.Module):
    """Sequence-parallel self-attention over the video tokens, q/k RMS-normed across heads, 3D RoPE."""

    def __init__(self, cfg: WanConfig, dtype: Any, rngs: nnx.Rngs):
        e = cfg.dim
        self.q = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.k = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.v = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.o = Linear(e, e, ("heads", "embed"), rngs=rngs, dtype=dtype, row_parallel=True)
        self.norm_q = _norm_weight(rngs, e, "heads")
        self.norm_k = _norm_weight(rngs, e, "heads")
        self.cfg = cfg

    def __call__(self, x: jax.Array, angles: jax.Array, ctx: ShardContext) -> jax.Array:
        cfg = self.cfg
        q, k = _rms_norm_across_heads(
            [self.q(x), self.k(x)], [self.norm_q, self.norm_k], cfg.dim, cfg.eps, ctx
        )
        dtype = self.q.dtype
        q = apply_rope(_heads(q, cfg.head_dim), angles).astype(dtype)
        k = apply_rope(_heads(k, cfg.head_dim), angles).astype(dtype)
        v = _heads(self.v(x), cfg.head_dim)
        out = ctx.attention(q, k, v)  # [B, N, H_local, D]
        return self.o(out.reshape(*out.shape[:2], -1), ctx)


class WanCrossAttention(nnx.Module):
    """Local attention of the video tokens to the text tokens (and, for I2V, separately to the image
    tokens, the two softmax outputs summed before ``o``). Context K/V are computed on every shard."""

    def __init__(self, cfg: WanConfig, dtype: Any, rngs: nnx.Rngs):
        e = cfg.dim
        self.q = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.k = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.v = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.o = Linear(e, e, ("heads", "embed"), rngs=rngs, dtype=dtype, row_parallel=True)
        self.norm_q = _norm_weight(rngs, e, "heads")
        self.norm_k = _norm_weight(rngs, e, "heads")
        if cfg.is_i2v:
            self.k_img = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
            self.v_img = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
            self.norm_k_img = _norm_weight(rngs, e, "heads")
        else:
            self.k_img = self.v_img = self.norm_k_img = None
        self.cfg = cfg

    def __call__(
        self, x: jax.Array, text: jax.Array, image: jax.Array | None, ctx: ShardContext
    ) -> jax.Array:
        cfg = self.cfg
        dtype = self.q.dtype
        use_image = self.k_img is not None
        if use_image and image is None:
            raise ValueError("an I2V Wan model needs the image context (encoder_hidden_states_image)")
        xs = [self.q(x), self.k(text)] + ([self.k_img(image)] if use_image else [])
        scales = [self.norm_q, self.norm_k] + ([self.norm_k_img] if use_image else [])
        normed = [
            _heads(n, cfg.head_dim).astype(dtype)
            for n in _rms_norm_across_heads(xs, scales, cfg.dim, cfg.eps, ctx)
        ]
        q, k = normed[0], normed[1]
        kernel = ctx.backend_options()  # the backend of self-attention (auto, xla, cudnn, triton, splash)
        out, _ = local_attention(q, k, _heads(self.v(text), cfg.head_dim), out_dtype=jnp.float32, **kernel)
        if use_image:
            out_img, _ = local_attention(
                q, normed[2], _heads(self.v_img(image), cfg.head_dim), out_dtype=jnp.float32, **kernel
            )
            out = out + out_img
        return self.o(out.reshape(*out.shape[:2], -1).astype(dtype), ctx)


class WanBlock(nnx.Module):
    """One transformer block: modulated self-attention, un-modulated cross-attention, modulated FFN."""

    def __init__(self, cfg: WanConfig, dtype: Any, rngs: nnx.Rngs):
        e = cfg.dim
        #: (shift, scale, gate) of self-attention, then of the FFN; added to the shared time projection.
        self.modulation = param(rngs, (6, e), (None, "embed"), jnp.float32, scale=e**-0.5)
        self.self_attn = WanSelfAttention(cfg, dtype, rngs)
        # The affine LayerNorm before cross-attention: original ``norm3``, diffusers ``norm2``.
        self.cross_norm_weight = _norm_weight(rngs, e, "embed")
        self.cross_norm_bias = param(rngs, (e,), ("embed",), jnp.float32, init="zeros")
        self.cross_attn = WanCrossAttention(cfg, dtype, rngs)
        self.ffn_in = Linear(e, cfg.ffn_dim, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.ffn_out = Linear(cfg.ffn_dim, e, ("mlp", "embed"), rngs=rngs, dtype=dtype, row_parallel=True)
        self.cfg = cfg

    def __call__(
        self,
        x: jax.Array,
        time_mod: jax.Array,
        text: jax.Array,
        image: jax.Array | None,
        angles: jax.Array,
        ctx: ShardContext,
        token_time: jax.Array | None = None,
    ) -> jax.Array:
        """``time_mod`` [B, 6, E] fp32, or [2, B, 6, E] with ``token_time`` (see :func:`token_modulation`)."""
        eps = self.cfg.eps
        dtype = self.ffn_in.dtype
        mods = token_modulation(time_mod, self.modulation[...], token_time)  # fp32
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = mods

        h = (layer_norm(x, eps) * (1 + scale_sa) + shift_sa).astype(dtype)
        x = x + self.self_attn(h, angles, ctx).astype(jnp.float32) * gate_sa

        h = _affine_layer_norm(x, self.cross_norm_weight, self.cross_norm_bias, eps).astype(dtype)
        x = x + self.cross_attn(h, text, image, ctx).astype(jnp.float32)

        h = (layer_norm(x, eps) * (1 + scale_ff) + shift_ff).astype(dtype)
        h = gelu_tanh(self.ffn_in(h).astype(jnp.float32)).astype(dtype)
        return x + self.ffn_out(h, ctx).astype(jnp.float32) * gate_ff


class WanImageEmbedding(nnx.Module):
    """I2V: CLIP features [B, I, 1280] -> LayerNorm -> Linear -> GELU (exact) -> Linear -> LayerNorm."""

    def __init__(self, cfg: WanConfig, dtype: Any, rngs: nnx.Rngs):
        d_in, e = cfg.image_dim, cfg.dim
        self.norm_in_weight = _norm_weight(rngs, d_in, None)
        self.norm_in_bias = param(rngs, (d_in,), (None,), jnp.float32, init="zeros")
        self.fc1 = Linear(d_in, d_in, (None, None), rngs=rngs, dtype=dtype)
        self.fc2 = Linear(d_in, e, (None, "embed"), rngs=rngs, dtype=dtype)
        self.norm_out_weight = _norm_weight(rngs, e, "embed")
        self.norm_out_bias = param(rngs, (e,), ("embed",), jnp.float32, init="zeros")

    def __call__(self, image: jax.Array) -> jax.Array:
        dtype = self.fc1.dtype
        # The CLIP projection's LayerNorms use torch's default eps, not the model's.
        h = _affine_layer_norm(image, self.norm_in_weight, self.norm_in_bias, 1e-5).astype(dtype)
        h = jax.nn.gelu(self.fc1(h).astype(jnp.float32), approximate=False).astype(dtype)
        return _affine_layer_norm(self.fc2(h), self.norm_out_weight, self.norm_out_bias, 1e-5).astype(dtype)
