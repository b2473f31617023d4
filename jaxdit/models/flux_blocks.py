"""FLUX.1's blocks in Flax NNX, the local view of one shard: the embedders, the double-stream (joint
attention over text and image) and single-stream blocks, and the final layer. ``models/flux.py`` holds
the config and the transformer that stacks them (its docstring has the parallel plan: which projections
are column- and row-parallel, what stays replicated, what runs in fp32).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.models.flux_config import TEXT, FluxConfig
from jaxdit.models.layers import (
    Linear,
    apply_rope,
    gelu_tanh,
    layer_norm,
    param,
    rms_norm,
)
from jaxdit.parallel.context import ShardContext

# --------------------------------------------------------------------------------------------------------
# Modules (local view)
# --------------------------------------------------------------------------------------------------------


def _fp32_out(layer: Linear, x: jax.Array) -> jax.Array:
    """A replicated Linear whose result stays fp32 (modulation): matmul in the weights' dtype, fp32 sum."""
    kernel = layer.kernel[...]
    y = jnp.einsum("...i,io->...o", x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
    return y if layer.bias is None else y + layer.bias[...].astype(jnp.float32)


def _modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """(1 + scale) * LN(x) + shift in fp32; shift/scale [B, E] broadcast over tokens."""
    return layer_norm(x) * (1.0 + scale[:, None]) + shift[:, None]


def _heads(x: jax.Array, head_dim: int) -> jax.Array:
    """[B, L, H_local*D] -> [B, L, H_local, D]: features are head-major, so tensor shards hold whole heads."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


class MLPEmbedder(nnx.Module):
    """Linear -> SiLU -> Linear on a [B, d_in] conditioning vector (BFL ``MLPEmbedder``); replicated."""

    def __init__(self, d_in: int, hidden: int, *, dtype: Any, rngs: nnx.Rngs):
        self.in_layer = Linear(d_in, hidden, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.out_layer = Linear(hidden, hidden, ("embed", "embed_out"), rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out_layer(jax.nn.silu(self.in_layer(x)))


class QKVProjection(nnx.Module):
    """Column-parallel q/k/v of one stream plus the QK RMSNorm scales (BFL ``QKNorm``)."""

    def __init__(self, cfg: FluxConfig, *, bias: bool, dtype: Any, rngs: nnx.Rngs):
        e = cfg.hidden_size
        # Separate kernels rather than BFL's fused [E, 3E]: a fused kernel split over "tensor" would give
        # a device a slab mixing q, k and v features instead of whole heads of each.
        self.q = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=bias)
        self.k = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=bias)
        self.v = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=bias)
        self.q_norm = param(rngs, (cfg.head_dim,), ("head_dim",), dtype, init="ones")
        self.k_norm = param(rngs, (cfg.head_dim,), ("head_dim",), dtype, init="ones")
        self.head_dim = cfg.head_dim

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, L, E] -> q, k (fp32, normed) and v (dtype), each [B, L, H_local, D]."""
        q = rms_norm(_heads(self.q(x), self.head_dim), self.q_norm[...])
        k = rms_norm(_heads(self.k(x), self.head_dim), self.k_norm[...])
        return q, k, _heads(self.v(x), self.head_dim)


class MLP(nnx.Module):
    """Linear(E, F) -> GELU(tanh) -> Linear(F, E): column- then row-parallel, one all-reduce."""

    def __init__(self, cfg: FluxConfig, *, dtype: Any, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.mlp_hidden
        self.fc1 = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.fc2 = Linear(f, e, ("mlp", "embed"), rngs=rngs, dtype=dtype, row_parallel=True)

    def __call__(self, x: jax.Array, ctx: ShardContext) -> jax.Array:
        return self.fc2(gelu_tanh(self.fc1(x).astype(jnp.float32)), ctx)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, angles: jax.Array, ctx: ShardContext) -> jax.Array:
    """RoPE (fp32) on joined per-shard q/k, then joint attention over every shard's tokens.

    Returns [B, L, H_local * D] in v's dtype.
    """
    q = apply_rope(q, angles).astype(v.dtype)
    k = apply_rope(k, angles).astype(v.dtype)
    out = ctx.attention(q, k, v)
    return out.reshape(*out.shape[:2], -1)


class DoubleStreamBlock(nnx.Module):
    """Separate weights for text and image tokens, joint attention over both (BFL ``DoubleStreamBlock``)."""

    def __init__(self, cfg: FluxConfig, *, dtype: Any, rngs: nnx.Rngs):
        e = cfg.hidden_size
        for stream in ("img", "txt"):
            # Modulation chunks, BFL order: shift1, scale1, gate1, shift2, scale2, gate2.
            setattr(self, f"{stream}_mod", Linear(e, 6 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype))
            setattr(self, f"{stream}_attn", QKVProjection(cfg, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs))
            setattr(
                self,
                f"{stream}_proj",
                Linear(e, e, ("heads", "embed"), rngs=rngs, dtype=dtype, row_parallel=True),
            )
            setattr(self, f"{stream}_mlp", MLP(cfg, dtype=dtype, rngs=rngs))

    def __call__(
        self, txt: jax.Array, img: jax.Array, vec: jax.Array, angles: jax.Array, ctx: ShardContext
    ) -> tuple[jax.Array, jax.Array]:
        """txt [B, T, E], img [B, N, E] fp32 residual streams; vec [B, E]; angles [1, T+N, D/2]."""
        dtype = self.img_proj.dtype
        streams = {"txt": txt, "img": img}
        mods, qkv = {}, {}
        for name, x in streams.items():
            mod = _fp32_out(getattr(self, f"{name}_mod"), jax.nn.silu(vec))
            mods[name] = jnp.split(mod, 6, axis=-1)
            shift, scale = mods[name][0], mods[name][1]
            qkv[name] = getattr(self, f"{name}_attn")(_modulate(x, shift, scale).astype(dtype))
        # Joint attention over [text; image], joined per shard only (the layout's group order).
        q, k, v = (ctx.layout.join_local([qkv["txt"][i], qkv["img"][i]]) for i in range(3))
        attn_txt, attn_img = ctx.layout.split_after(_attend(q, k, v, angles, ctx), TEXT)
        out = {}
        for name, attn in (("txt", attn_txt), ("img", attn_img)):
            shift1, scale1, gate1, shift2, scale2, gate2 = mods[name]
            x = streams[name] + gate1[:, None] * getattr(self, f"{name}_proj")(attn, ctx)
            mlp_in = _modulate(x, shift2, scale2).astype(dtype)
            out[name] = x + gate2[:, None] * getattr(self, f"{name}_mlp")(mlp_in, ctx)
        return out["txt"], out["img"]


class SingleStreamBlock(nnx.Module):
    """Parallel attention + MLP on the joined sequence (BFL ``SingleStreamBlock``, arXiv 2302.05442).

    BFL's fused ``linear1`` is held as q, k, v and ``mlp_in``; ``linear2`` as ``out_attn`` (with the bias)
    and ``out_mlp`` (no bias), whose partial sums share one all-reduce.
    """

    def __init__(self, cfg: FluxConfig, *, dtype: Any, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.mlp_hidden
        self.modulation = Linear(
            e, 3 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype
        )  # shift, scale, gate
        self.attn = QKVProjection(cfg, bias=True, dtype=dtype, rngs=rngs)  # BFL's linear1 always has a bias
        self.mlp_in = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.out_attn = Linear(e, e, ("heads", "embed"), rngs=rngs, dtype=dtype)
        self.out_mlp = Linear(f, e, ("mlp", "embed"), rngs=rngs, dtype=dtype, bias=False)

    def __call__(self, x: jax.Array, vec: jax.Array, angles: jax.Array, ctx: ShardContext) -> jax.Array:
        """x [B, T+N, E] fp32 (this shard's [text; image]); returns the updated stream."""
        dtype = self.mlp_in.dtype
        shift, scale, gate = jnp.split(_fp32_out(self.modulation, jax.nn.silu(vec)), 3, axis=-1)
        h = _modulate(x, shift, scale).astype(dtype)
        q, k, v = self.attn(h)
        attn = _attend(q, k, v, angles, ctx)
        mlp = gelu_tanh(self.mlp_in(h).astype(jnp.float32))
        # Row-parallel over both halves of linear2's input: add the partial sums, then one all-reduce.
        partial = self.out_attn.partial_sum(attn, ctx) + self.out_mlp.partial_sum(mlp, ctx)
        out = ctx.sum_tensor_parallel(partial) + self.out_attn.bias[...].astype(jnp.float32)
        return x + gate[:, None] * out


class LastLayer(nnx.Module):
    """AdaLN (shift first, BFL order) -> Linear(E, out_channels)."""

    def __init__(self, cfg: FluxConfig, *, dtype: Any, rngs: nnx.Rngs):
        e = cfg.hidden_size
        self.adaLN_modulation = Linear(e, 2 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype)
        self.linear = Linear(e, cfg.out_channels, ("embed", "out_features"), rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array, vec: jax.Array) -> jax.Array:
        shift, scale = jnp.split(_fp32_out(self.adaLN_modulation, jax.nn.silu(vec)), 2, axis=-1)
        return self.linear(_modulate(x, shift, scale).astype(self.linear.dtype))


def _stack(make, n: int, rngs: nnx.Rngs):
    """``n`` blocks with a leading layer axis on every parameter, each from its own RNG stream."""
    if n == 0:
        return None

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r: nnx.Rngs):
        return make(r)

    return build(rngs)
