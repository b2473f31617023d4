"""HunyuanVideo 1.5's blocks in Flax NNX, the local view of one shard: the embedders of the three kinds of
condition tokens, the token-refiner block the prompt tokens pass first, and the dual-stream block.
Follows diffusers' ``HunyuanVideo15IndividualTokenRefinerBlock``, ``HunyuanVideo15ByT5TextProjection``,
``HunyuanVideo15ImageProjection`` and ``HunyuanVideo15TransformerBlock``
(``models/transformers/transformer_hunyuan_video15.py``); ``models/hunyuan_video15.py`` stacks them.

Shape letters: B batch, T condition tokens (this shard's), N video tokens (this shard's), H heads (this
tensor shard's), D head_dim, E hidden.
Precision: weights and matmuls in the model's dtype with fp32 accumulation; the residual streams, norms,
RoPE, AdaLN modulation and softmax statistics in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.models.hunyuan_video15_config import GLYPH_HIDDEN, VIDEO, HunyuanVideo15Config
from jaxdit.models.layers import Linear, apply_rope, gelu_tanh, layer_norm, param, rms_norm
from jaxdit.parallel.context import ShardContext

__all__ = [
    "EPS",
    "AffineNorm",
    "DualStreamBlock",
    "GlyphProjection",
    "ImageProjection",
    "RefinerBlock",
    "TimestepEmbedder",
    "modulate_input",
    "modulation",
]

#: Epsilon of the blocks' LayerNorms and QK RMSNorms (diffusers' 1e-6).
EPS = 1e-6
#: Epsilon of the embedders' affine LayerNorms (torch's default 1e-5).
EMBED_EPS = 1e-5

Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def modulation(layer: Linear, temb: jax.Array) -> jax.Array:
    """``layer(silu(temb))`` kept in fp32 (AdaLN parameters and gates): matmul in the weights' dtype,
    fp32 sum. Replicated: computed once per step from a [B, E] vector."""
    kernel = layer.kernel[...]
    x = jax.nn.silu(temb.astype(jnp.float32)).astype(kernel.dtype)
    y = jnp.einsum("...i,io->...o", x, kernel, preferred_element_type=jnp.float32)
    return y + layer.bias[...].astype(jnp.float32)


def _heads(x: jax.Array, head_dim: int) -> jax.Array:
    """[B, L, H_local*D] -> [B, L, H_local, D] (features head-major: tensor shards hold whole heads)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


def _modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """LN(x) * (1 + scale) + shift in fp32; shift/scale [B, E] broadcast over tokens."""
    return layer_norm(x, EPS) * (1.0 + scale[:, None]) + shift[:, None]


def modulate_input(block: DualStreamBlock, video: jax.Array, temb: jax.Array) -> jax.Array:
    """A dual-stream block's modulated video input, LN(video) * (1 + scale1) + shift1 in fp32 (TeaCache's
    metric input, ``models/hunyuan_video15_cache_hooks.py``)."""
    shift, scale = jnp.split(modulation(block.norm1, temb), 6, axis=-1)[:2]
    return _modulate(video, shift, scale)


class AffineNorm(nnx.Module):
    """torch's ``LayerNorm`` with a weight and a bias, computed in fp32 (returns fp32)."""

    def __init__(self, size: int, axis: str, *, eps: float, dtype: Any, rngs: nnx.Rngs):
        self.weight = param(rngs, (size,), (axis,), dtype, init="ones")
        self.bias = param(rngs, (size,), (axis,), dtype, init="zeros")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.eps) * self.weight[...].astype(jnp.float32) + self.bias[...].astype(
            jnp.float32
        )


class TimestepEmbedder(nnx.Module):
    """diffusers' ``TimestepEmbedding`` (Linear -> SiLU -> Linear) and ``PixArtAlphaTextProjection`` (the
    same shape, on the pooled prompt): replicated, fp32 out."""

    def __init__(self, d_in: int, hidden: int, *, dtype: Any, rngs: nnx.Rngs):
        self.linear_1 = Linear(d_in, hidden, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.linear_2 = Linear(hidden, hidden, ("embed", "embed_out"), rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.silu(self.linear_1(x).astype(jnp.float32)).astype(self.linear_2.dtype)
        return self.linear_2(h).astype(jnp.float32)


class GlyphProjection(nnx.Module):
    """The ByT5 mapper: LayerNorm -> Linear(C2, 2048) -> GELU -> Linear(2048, 2048) -> GELU ->
    Linear(2048, E); per token, replicated."""

    def __init__(self, cfg: HunyuanVideo15Config, *, dtype: Any, rngs: nnx.Rngs):
        c, g, e = cfg.text_embed_2_dim, GLYPH_HIDDEN, cfg.hidden_size
        self.norm = AffineNorm(c, "in_features", eps=EMBED_EPS, dtype=dtype, rngs=rngs)
        self.linear_1 = Linear(c, g, ("in_features", "glyph_hidden"), rngs=rngs, dtype=dtype)
        self.linear_2 = Linear(g, g, ("glyph_hidden", "glyph_hidden_out"), rngs=rngs, dtype=dtype)
        self.linear_3 = Linear(g, e, ("glyph_hidden", "embed"), rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.linear_1.dtype
        h = jax.nn.gelu(self.linear_1(self.norm(x).astype(dtype)).astype(jnp.float32), approximate=False)
        h = jax.nn.gelu(self.linear_2(h.astype(dtype)).astype(jnp.float32), approximate=False)
        return self.linear_3(h.astype(dtype)).astype(jnp.float32)


class ImageProjection(nnx.Module):
    """The image encoder's tokens: LayerNorm -> Linear(C3, C3) -> GELU -> Linear(C3, E) -> LayerNorm."""

    def __init__(self, cfg: HunyuanVideo15Config, *, dtype: Any, rngs: nnx.Rngs):
        c, e = cfg.image_embed_dim, cfg.hidden_size
        self.norm_in = AffineNorm(c, "in_features", eps=EMBED_EPS, dtype=dtype, rngs=rngs)
        self.linear_1 = Linear(c, c, ("in_features", "image_hidden"), rngs=rngs, dtype=dtype)
        self.linear_2 = Linear(c, e, ("image_hidden", "embed"), rngs=rngs, dtype=dtype)
        self.norm_out = AffineNorm(e, "embed", eps=EMBED_EPS, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.linear_1.dtype
        h = jax.nn.gelu(self.linear_1(self.norm_in(x).astype(dtype)).astype(jnp.float32), approximate=False)
        return self.norm_out(self.linear_2(h.astype(dtype)))


class FeedForward(nnx.Module):
    """Linear(E, F) -> activation -> Linear(F, E): column- then row-parallel, one all-reduce."""

    def __init__(self, cfg: HunyuanVideo15Config, activation, *, dtype: Any, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.mlp_hidden
        self.proj = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.out = Linear(f, e, ("mlp", "embed"), rngs=rngs, dtype=dtype, row_parallel=True)
        self.activation = activation

    def __call__(self, x: jax.Array, ctx: ShardContext) -> jax.Array:
        h = self.activation(self.proj(x).astype(jnp.float32)).astype(self.out.dtype)
        return self.out(h, ctx)


class RefinerBlock(nnx.Module):
    """One ``HunyuanVideo15IndividualTokenRefinerBlock`` over the prompt tokens alone: affine LayerNorm ->
    self-attention (no QK norm, no RoPE) and affine LayerNorm -> SiLU MLP, each gated by a vector of the
    refiner's own conditioning (timestep + pooled prompt); ``attend`` attends over the prompt group."""

    def __init__(self, cfg: HunyuanVideo15Config, *, dtype: Any, rngs: nnx.Rngs):
        e = cfg.hidden_size
        self.norm1 = AffineNorm(e, "embed", eps=EPS, dtype=dtype, rngs=rngs)
        self.to_q, self.to_k, self.to_v = (
            Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype) for _ in range(3)
        )
        self.to_out = Linear(e, e, ("heads", "embed"), rngs=rngs, dtype=dtype, row_parallel=True)
        self.norm2 = AffineNorm(e, "embed", eps=EPS, dtype=dtype, rngs=rngs)
        self.ff = FeedForward(cfg, jax.nn.silu, dtype=dtype, rngs=rngs)
        self.norm_out = Linear(e, 2 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype)  # two gates
        self.head_dim = cfg.head_dim

    def __call__(self, x: jax.Array, temb: jax.Array, attend: Attend, ctx: ShardContext) -> jax.Array:
        """x [B, T, E] fp32 prompt stream, temb [B, E] the refiner's conditioning."""
        dtype = self.to_q.dtype
        h = self.norm1(x).astype(dtype)
        q, k, v = (_heads(lin(h), self.head_dim) for lin in (self.to_q, self.to_k, self.to_v))
        out = attend(q, k, v)
        gate_msa, gate_mlp = jnp.split(modulation(self.norm_out, temb), 2, axis=-1)
        x = x + gate_msa[:, None] * self.to_out(out.reshape(*out.shape[:2], -1), ctx).astype(jnp.float32)
        ff = self.ff(self.norm2(x).astype(dtype), ctx).astype(jnp.float32)
        return x + gate_mlp[:, None] * ff


class DualStreamBlock(nnx.Module):
    """One ``HunyuanVideo15TransformerBlock``: AdaLN-modulated joint attention over [video; condition
    tokens] (separate weights per stream, RMS QK-norm, RoPE on the video tokens only), then per-stream
    tanh-GELU MLPs. Modulation chunks: shift1, scale1, gate1, shift2, scale2, gate2."""

    def __init__(self, cfg: HunyuanVideo15Config, *, dtype: Any, rngs: nnx.Rngs):
        e, d = cfg.hidden_size, cfg.head_dim

        def linear(axes, **kw):
            return Linear(e, e, axes, rngs=rngs, dtype=dtype, **kw)

        def norm():
            return param(rngs, (d,), ("head_dim",), dtype, init="ones")

        self.norm1 = Linear(e, 6 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype)
        self.norm1_context = Linear(e, 6 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype)
        self.to_q, self.to_k, self.to_v = (linear(("embed", "heads")) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (linear(("embed", "heads")) for _ in range(3))
        self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = (norm() for _ in range(4))
        self.to_out = linear(("heads", "embed"), row_parallel=True)
        self.to_add_out = linear(("heads", "embed"), row_parallel=True)
        self.ff = FeedForward(cfg, gelu_tanh, dtype=dtype, rngs=rngs)
        self.ff_context = FeedForward(cfg, gelu_tanh, dtype=dtype, rngs=rngs)
        self.head_dim = d

    def __call__(
        self, video: jax.Array, cond: jax.Array, temb: jax.Array, angles: jax.Array, ctx: ShardContext
    ) -> tuple[jax.Array, jax.Array]:
        """video [B, N, E] and cond [B, T, E] fp32 streams (cond: this shard's prompt, glyph and image
        tokens joined), temb [B, E], angles [1, N, D/2] of the video tokens. The condition tokens' key
        mask is ``ctx``'s."""
        dtype, d = self.to_q.dtype, self.head_dim
        v_mod = jnp.split(modulation(self.norm1, temb), 6, axis=-1)
        c_mod = jnp.split(modulation(self.norm1_context, temb), 6, axis=-1)
        v_in = _modulate(video, v_mod[0], v_mod[1]).astype(dtype)  # = modulate_input(self, video, temb)
        c_in = _modulate(cond, c_mod[0], c_mod[1]).astype(dtype)
        v_q = apply_rope(rms_norm(_heads(self.to_q(v_in), d), self.norm_q[...], EPS), angles).astype(dtype)
        v_k = apply_rope(rms_norm(_heads(self.to_k(v_in), d), self.norm_k[...], EPS), angles).astype(dtype)
        c_q = rms_norm(_heads(self.add_q_proj(c_in), d), self.norm_added_q[...], EPS).astype(dtype)
        c_k = rms_norm(_heads(self.add_k_proj(c_in), d), self.norm_added_k[...], EPS).astype(dtype)
        v_v, c_v = _heads(self.to_v(v_in), d), _heads(self.add_v_proj(c_in), d)
        # Joint attention, joined per shard only (the layout's group order: video first).
        q, k, v = (ctx.layout.join_local(pair) for pair in ((v_q, c_q), (v_k, c_k), (v_v, c_v)))
        out = ctx.attention(q, k, v)
        attn_v, attn_c = ctx.layout.split_after(out.reshape(*out.shape[:2], -1), VIDEO)

        video = video + v_mod[2][:, None] * self.to_out(attn_v, ctx).astype(jnp.float32)
        ff = self.ff(_modulate(video, v_mod[3], v_mod[4]).astype(dtype), ctx)
        video = video + v_mod[5][:, None] * ff.astype(jnp.float32)
        cond = cond + c_mod[2][:, None] * self.to_add_out(attn_c, ctx).astype(jnp.float32)
        ff = self.ff_context(_modulate(cond, c_mod[3], c_mod[4]).astype(dtype), ctx)
        cond = cond + c_mod[5][:, None] * ff.astype(jnp.float32)
        return video, cond
