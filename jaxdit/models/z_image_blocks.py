"""Z-Image's blocks in Flax NNX, the local view of one shard: the timestep embedder, the single-stream
block (with timestep modulation in the noise refiner and the joint layers, without it in the context
refiner) and the SwiGLU feed-forward. Follows diffusers' ``ZImageTransformerBlock`` /
``TimestepEmbedder`` / ``FeedForward`` (``transformer_z_image.py``); ``models/z_image.py`` stacks them.

Shape letters: B batch, L tokens (this shard's), H heads (this tensor shard's), D head_dim, E dim.
Precision: weights and matmuls in the model's dtype with fp32 accumulation; the residual stream, norms,
RoPE, modulation and softmax statistics in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.models.layers import Linear, apply_rope, param, rms_norm
from jaxdit.models.z_image_config import TIME_HIDDEN, ZImageConfig
from jaxdit.parallel.context import ShardContext

__all__ = ["QK_EPS", "FeedForward", "SingleStreamBlock", "TimestepEmbedder", "linear_fp32"]

#: The QK-norm epsilon (diffusers' ``Attention(eps=1e-5)``, independent of ``norm_eps``).
QK_EPS = 1e-5

Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def linear_fp32(layer: Linear, x: jax.Array) -> jax.Array:
    """``layer(x)`` kept in fp32 (modulation parameters): matmul in the weights' dtype, fp32 sum."""
    kernel = layer.kernel[...]
    y = jnp.einsum("...i,io->...o", x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
    return y + layer.bias[...].astype(jnp.float32)


class TimestepEmbedder(nnx.Module):
    """Linear(256, 1024) -> SiLU -> Linear(1024, min(E, 256)); replicated."""

    def __init__(self, cfg: ZImageConfig, *, dtype: Any, rngs: nnx.Rngs):
        self.linear_1 = Linear(256, TIME_HIDDEN, ("in_features", "time_hidden"), rngs=rngs, dtype=dtype)
        self.linear_2 = Linear(TIME_HIDDEN, cfg.adaln_dim, ("time_hidden", "adaln"), rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return linear_fp32(self.linear_2, jax.nn.silu(linear_fp32(self.linear_1, x)))


class FeedForward(nnx.Module):
    """w2(silu(w1 x) * w3 x), no biases: w1/w3 column-, w2 row-parallel (one all-reduce)."""

    def __init__(self, cfg: ZImageConfig, *, dtype: Any, rngs: nnx.Rngs):
        e, f = cfg.dim, cfg.mlp_hidden
        self.w1 = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype, bias=False)
        self.w3 = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype, bias=False)
        self.w2 = Linear(f, e, ("mlp", "embed"), rngs=rngs, dtype=dtype, bias=False, row_parallel=True)

    def __call__(self, x: jax.Array, ctx: ShardContext) -> jax.Array:
        gate = jax.nn.silu(self.w1(x).astype(jnp.float32)) * self.w3(x).astype(jnp.float32)
        return self.w2(gate.astype(x.dtype), ctx)


def _heads(x: jax.Array, head_dim: int) -> jax.Array:
    """[B, L, H_local*D] -> [B, L, H_local, D] (features head-major: tensor shards hold whole heads)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


class SingleStreamBlock(nnx.Module):
    """One ``ZImageTransformerBlock`` on one stream: pre- and post-norms (RMSNorm) around attention and
    the feed-forward; with ``modulation`` the timestep gives (scale_msa, gate_msa, scale_mlp, gate_mlp)
    through one linear layer (no SiLU before it), scales as 1 + s and gates through tanh.

    Attention is whatever ``attend`` does with this shard's q, k, v: joint over [image; caption] in the
    main layers, over one token group in the refiners (``models/z_image.py`` decides)."""

    def __init__(self, cfg: ZImageConfig, *, modulation: bool, dtype: Any, rngs: nnx.Rngs):
        e, d = cfg.dim, cfg.head_dim

        def norm(size, axis):
            return param(rngs, (size,), (axis,), dtype, init="ones")

        self.to_q, self.to_k, self.to_v = (
            Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=False) for _ in range(3)
        )
        self.to_out = Linear(e, e, ("heads", "embed"), rngs=rngs, dtype=dtype, bias=False, row_parallel=True)
        self.norm_q, self.norm_k = norm(d, "head_dim"), norm(d, "head_dim")
        self.feed_forward = FeedForward(cfg, dtype=dtype, rngs=rngs)
        self.attention_norm1, self.attention_norm2 = norm(e, "embed"), norm(e, "embed")
        self.ffn_norm1, self.ffn_norm2 = norm(e, "embed"), norm(e, "embed")
        self.modulation = modulation
        self.adaLN_modulation = (
            Linear(cfg.adaln_dim, 4 * e, ("adaln", "modulation"), rngs=rngs, dtype=dtype)
            if modulation
            else None
        )
        self.head_dim = d
        self.eps = cfg.norm_eps

    def _modulation(self, temb: jax.Array | None) -> tuple[Any, Any, Any, Any]:
        """(scale_msa, gate_msa, scale_mlp, gate_mlp), each [B, 1, E] (1.0 without modulation)."""
        if not self.modulation:
            return 1.0, 1.0, 1.0, 1.0
        mods = jnp.split(linear_fp32(self.adaLN_modulation, temb), 4, axis=-1)
        return (
            1.0 + mods[0][:, None],
            jnp.tanh(mods[1])[:, None],
            1.0 + mods[2][:, None],
            jnp.tanh(mods[3])[:, None],
        )

    def modulated_input(self, x: jax.Array, temb: jax.Array | None) -> jax.Array:
        """The attention's input RMSNorm(x) * (1 + scale_msa), fp32 (TeaCache's metric input)."""
        return rms_norm(x, self.attention_norm1[...], self.eps) * self._modulation(temb)[0]

    def __call__(
        self, x: jax.Array, temb: jax.Array | None, angles: jax.Array, attend: Attend, ctx: ShardContext
    ) -> jax.Array:
        """x [B, L, E] fp32 stream; temb [B, adaln] (modulated blocks); angles [B, L, D/2]."""
        dtype = self.to_q.kernel.dtype
        eps = self.eps
        scale_msa, gate_msa, scale_mlp, gate_mlp = self._modulation(temb)
        h = (rms_norm(x, self.attention_norm1[...], eps) * scale_msa).astype(dtype)
        q = apply_rope(rms_norm(_heads(self.to_q(h), self.head_dim), self.norm_q[...], QK_EPS), angles)
        k = apply_rope(rms_norm(_heads(self.to_k(h), self.head_dim), self.norm_k[...], QK_EPS), angles)
        out = attend(q.astype(dtype), k.astype(dtype), _heads(self.to_v(h), self.head_dim))
        out = self.to_out(out.reshape(*out.shape[:2], -1), ctx)
        x = x + gate_msa * rms_norm(out, self.attention_norm2[...], eps)
        h = (rms_norm(x, self.ffn_norm1[...], eps) * scale_mlp).astype(dtype)
        return x + gate_mlp * rms_norm(self.feed_forward(h, ctx), self.ffn_norm2[...], eps)
