"""Qwen-Image's blocks in Flax NNX, the local view of one shard: the timestep embedder, the dual-stream
block (separate weights for text and image tokens, joint attention over [text; image] with the text key
mask) and the output layer. Follows diffusers' ``QwenImageTransformerBlock`` / ``QwenImageTransformer2DModel``
(``transformer_qwenimage.py``); ``models/qwen_image.py`` stacks them and holds the parallel plan.

Shape letters: B batch, T text tokens, N image tokens (this shard's), H heads, D head_dim, E hidden.
Precision: weights and matmuls in the model's dtype with fp32 accumulation; the residual streams, norms,
RoPE, AdaLN modulation and softmax statistics in fp32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.models.layers import Linear, apply_rope, gelu_tanh, layer_norm, param, rms_norm
from jaxdit.models.qwen_image_config import TEXT, QwenImageConfig
from jaxdit.parallel.context import ShardContext

__all__ = ["DualStreamBlock", "FeedForward", "TimestepEmbedder", "modulation"]

#: Norm epsilon of every LayerNorm / RMSNorm in the model (diffusers' 1e-6).
EPS = 1e-6


def modulation(layer: Linear, temb: jax.Array) -> jax.Array:
    """``layer(silu(temb))`` kept in fp32 (AdaLN parameters): matmul in the weights' dtype, fp32 sum.
    Replicated: computed once per step from a [B, E] vector."""
    kernel = layer.kernel[...]
    x = jax.nn.silu(temb.astype(jnp.float32)).astype(kernel.dtype)
    y = jnp.einsum("...i,io->...o", x, kernel, preferred_element_type=jnp.float32)
    return y + layer.bias[...].astype(jnp.float32)


def _modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """LN(x) * (1 + scale) + shift in fp32; shift/scale [B, E] broadcast over tokens, or per token
    [B, N, E]."""
    if shift.ndim == 2:
        shift, scale = shift[:, None], scale[:, None]
    return layer_norm(x, EPS) * (1.0 + scale) + shift


def _per_token(mods: list[jax.Array]) -> list[jax.Array]:
    return [m[:, None] if m.ndim == 2 else m for m in mods]


def _heads(x: jax.Array, head_dim: int) -> jax.Array:
    """[B, L, H_local*D] -> [B, L, H_local, D] (features head-major: tensor shards hold whole heads)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


class TimestepEmbedder(nnx.Module):
    """diffusers' ``TimestepEmbedding``: Linear(256, E) -> SiLU -> Linear(E, E); replicated."""

    def __init__(self, d_in: int, hidden: int, *, dtype: Any, rngs: nnx.Rngs):
        self.linear_1 = Linear(d_in, hidden, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.linear_2 = Linear(hidden, hidden, ("embed", "embed_out"), rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(jax.nn.silu(self.linear_1(x).astype(jnp.float32)))


class FeedForward(nnx.Module):
    """Linear(E, 4E) -> GELU(tanh) -> Linear(4E, E): column- then row-parallel, one all-reduce."""

    def __init__(self, cfg: QwenImageConfig, *, dtype: Any, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.mlp_ratio * cfg.hidden_size
        self.proj = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.out = Linear(f, e, ("mlp", "embed"), rngs=rngs, dtype=dtype, row_parallel=True)

    def __call__(self, x: jax.Array, ctx: ShardContext) -> jax.Array:
        return self.out(gelu_tanh(self.proj(x).astype(jnp.float32)), ctx)


class DualStreamBlock(nnx.Module):
    """One ``QwenImageTransformerBlock``: AdaLN-modulated joint attention, then per-stream MLPs.

    Image-stream projections keep diffusers' names (``to_q``, ``to_out``), the text stream's their
    ``add_*`` / ``to_add_out`` names. Modulation chunks: shift1, scale1, gate1, shift2, scale2, gate2.
    """

    def __init__(self, cfg: QwenImageConfig, *, dtype: Any, rngs: nnx.Rngs):
        e, d = cfg.hidden_size, cfg.head_dim

        def linear(axes, **kw):
            return Linear(e, e, axes, rngs=rngs, dtype=dtype, **kw)

        def norm():
            return param(rngs, (d,), ("head_dim",), dtype, init="ones")

        self.img_mod = Linear(e, 6 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype)
        self.txt_mod = Linear(e, 6 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype)
        self.to_q, self.to_k, self.to_v = (linear(("embed", "heads")) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (linear(("embed", "heads")) for _ in range(3))
        self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = (norm() for _ in range(4))
        self.to_out = linear(("heads", "embed"), row_parallel=True)
        self.to_add_out = linear(("heads", "embed"), row_parallel=True)
        self.img_mlp = FeedForward(cfg, dtype=dtype, rngs=rngs)
        self.txt_mlp = FeedForward(cfg, dtype=dtype, rngs=rngs)
        self.head_dim = d

    def image_modulations(
        self, temb: jax.Array, tokens: int, reference_temb: jax.Array | None = None, image_tokens: int = 0
    ) -> list[jax.Array]:
        """The image stream's six AdaLN chunks [B, 1 | tokens, E] from ``temb``; with ``reference_temb``
        (Edit-2511) the tokens from ``image_tokens`` on (this shard's reference tokens) take theirs from it."""
        mods = _per_token(jnp.split(modulation(self.img_mod, temb), 6, axis=-1))
        if reference_temb is None:
            return mods
        clean = _per_token(jnp.split(modulation(self.img_mod, reference_temb), 6, axis=-1))
        is_ref = (jnp.arange(tokens) >= image_tokens)[None, :, None]
        return [jnp.where(is_ref, c, m) for m, c in zip(mods, clean, strict=True)]

    def _qkv(self, x: jax.Array, q: Linear, k: Linear, v: Linear, qn: nnx.Param, kn: nnx.Param, angles):
        """One stream's q, k (RMS-normed per head, rotated; fp32 math) and v, cast to the compute dtype."""
        dtype = q.dtype
        qh = apply_rope(rms_norm(_heads(q(x), self.head_dim), qn[...], EPS), angles).astype(dtype)
        kh = apply_rope(rms_norm(_heads(k(x), self.head_dim), kn[...], EPS), angles).astype(dtype)
        return qh, kh, _heads(v(x), self.head_dim)

    def __call__(
        self,
        txt: jax.Array,
        img: jax.Array,
        temb: jax.Array,
        angles: tuple[jax.Array, jax.Array],
        ctx: ShardContext,
        reference_temb: jax.Array | None = None,
        image_tokens: int = 0,
    ) -> tuple[jax.Array, jax.Array]:
        """txt [B, T, E], img [B, N, E] fp32 streams; temb [B, E]; angles (text, image) [1, *, D/2]. The
        prompts' key mask is ``ctx``'s (``ctx.attention`` masks it). ``reference_temb`` [B, E]
        (Edit-2511's ``zero_cond_t``): the image stream's tokens from ``image_tokens`` on (this shard's
        reference tokens) take their modulation from it (timestep 0) instead of ``temb``."""
        dtype = self.to_q.dtype
        img_mods = self.image_modulations(temb, img.shape[1], reference_temb, image_tokens)
        txt_mods = jnp.split(modulation(self.txt_mod, temb), 6, axis=-1)
        img_in = _modulate(img, img_mods[0], img_mods[1]).astype(dtype)
        txt_in = _modulate(txt, txt_mods[0], txt_mods[1]).astype(dtype)
        i_q, i_k, i_v = self._qkv(
            img_in, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k, angles[1]
        )
        t_q, t_k, t_v = self._qkv(
            txt_in,
            self.add_q_proj,
            self.add_k_proj,
            self.add_v_proj,
            self.norm_added_q,
            self.norm_added_k,
            angles[0],
        )
        # Joint attention over [text; image], joined per shard only (the layout's group order).
        q, k, v = (ctx.layout.join_local(pair) for pair in ((t_q, i_q), (t_k, i_k), (t_v, i_v)))
        out = ctx.attention(q, k, v)
        attn_txt, attn_img = ctx.layout.split_after(out.reshape(*out.shape[:2], -1), TEXT)

        img = img + img_mods[2] * self.to_out(attn_img, ctx).astype(jnp.float32)
        img = img + img_mods[5] * self.img_mlp(
            _modulate(img, img_mods[3], img_mods[4]).astype(dtype), ctx
        ).astype(jnp.float32)
        txt = txt + txt_mods[2][:, None] * self.to_add_out(attn_txt, ctx).astype(jnp.float32)
        txt = txt + txt_mods[5][:, None] * self.txt_mlp(
            _modulate(txt, txt_mods[3], txt_mods[4]).astype(dtype), ctx
        ).astype(jnp.float32)
        return txt, img
