"""FLUX.2's blocks in Flax NNX, the local view of one shard: the double-stream (joint attention over
text and image, separate weights per stream) and single-stream (parallel attention + MLP) blocks with
bias-free SwiGLU MLPs. Unlike FLUX.1 a block holds no modulation weights: the transformer computes the
double blocks' and the single blocks' AdaLN vectors once per step and every block of a stack reads the
same ones (``models/flux2.py`` holds the transformer and its parallel plan).

Tensor parallel, as FLUX.1's blocks: q/k/v and the SwiGLU's gate and value projections column-parallel
("heads" / "mlp"), the attention-output and MLP-down projections row-parallel with one all-reduce each;
a single block's fused input and output projections are held as their parts, so that a tensor shard
holds whole heads and matching gate/value units, and its two output parts share one all-reduce.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.models.flux2_config import TEXT, Flux2Config
from jaxdit.models.flux_blocks import _attend, _heads
from jaxdit.models.layers import Linear, layer_norm, param, rms_norm
from jaxdit.parallel.context import ShardContext


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """(1 + scale) * LN(x) + shift in fp32; shift/scale [B, E] broadcast over tokens."""
    return layer_norm(x, eps) * (1.0 + scale[:, None]) + shift[:, None]


class QKNormProjection(nnx.Module):
    """Bias-free column-parallel q/k/v of one stream and the RMSNorm scales of q and k (per head_dim)."""

    def __init__(self, cfg: Flux2Config, *, dtype: Any, rngs: nnx.Rngs):
        e = cfg.hidden_size
        self.q = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=False)
        self.k = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=False)
        self.v = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=False)
        self.q_norm = param(rngs, (cfg.head_dim,), ("head_dim",), dtype, init="ones")
        self.k_norm = param(rngs, (cfg.head_dim,), ("head_dim",), dtype, init="ones")
        self.head_dim, self.eps = cfg.head_dim, cfg.eps

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, L, E] -> q, k (fp32, normed) and v (dtype), each [B, L, H_local, D]."""
        q = rms_norm(_heads(self.q(x), self.head_dim), self.q_norm[...], self.eps)
        k = rms_norm(_heads(self.k(x), self.head_dim), self.k_norm[...], self.eps)
        return q, k, _heads(self.v(x), self.head_dim)


def swiglu(gate: jax.Array, value: jax.Array) -> jax.Array:
    """SiLU(gate) * value in fp32 (diffusers' ``Flux2SwiGLU`` on the two halves of a fused projection)."""
    return jax.nn.silu(gate.astype(jnp.float32)) * value.astype(jnp.float32)


class SwiGLUMLP(nnx.Module):
    """Bias-free SwiGLU feed-forward: gate and value E -> F (column-parallel), down F -> E (row-parallel).

    diffusers' ``linear_in`` [2F, E] holds the gate rows first, then the value rows.
    """

    def __init__(self, cfg: Flux2Config, *, dtype: Any, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.mlp_hidden
        self.gate = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype, bias=False)
        self.value = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype, bias=False)
        self.down = Linear(f, e, ("mlp", "embed"), rngs=rngs, dtype=dtype, bias=False, row_parallel=True)

    def __call__(self, x: jax.Array, ctx: ShardContext) -> jax.Array:
        return self.down(swiglu(self.gate(x), self.value(x)), ctx)


class DoubleStreamBlock(nnx.Module):
    """Separate text and image weights, joint attention over both (diffusers ``Flux2TransformerBlock``)."""

    def __init__(self, cfg: Flux2Config, *, dtype: Any, rngs: nnx.Rngs):
        e = cfg.hidden_size
        for stream in ("img", "txt"):
            setattr(self, f"{stream}_attn", QKNormProjection(cfg, dtype=dtype, rngs=rngs))
            setattr(
                self,
                f"{stream}_proj",
                Linear(e, e, ("heads", "embed"), rngs=rngs, dtype=dtype, bias=False, row_parallel=True),
            )
            setattr(self, f"{stream}_mlp", SwiGLUMLP(cfg, dtype=dtype, rngs=rngs))
        self.eps = cfg.eps

    def __call__(
        self,
        txt: jax.Array,
        img: jax.Array,
        mod_txt: jax.Array,
        mod_img: jax.Array,
        angles: jax.Array,
        ctx: ShardContext,
    ) -> tuple[jax.Array, jax.Array]:
        """txt [B, T, E], img [B, N, E] fp32 streams; mod_* [B, 6E] fp32, the stack's shared modulation
        (shift, scale, gate of attention, then of the MLP); angles [1, T+N, D/2]."""
        dtype = self.img_proj.dtype
        streams = {"txt": txt, "img": img}
        mods = {"txt": jnp.split(mod_txt, 6, axis=-1), "img": jnp.split(mod_img, 6, axis=-1)}
        qkv = {}
        for name, x in streams.items():
            shift, scale = mods[name][0], mods[name][1]
            qkv[name] = getattr(self, f"{name}_attn")(modulate(x, shift, scale, self.eps).astype(dtype))
        # Joint attention over [text; image], joined per shard only (the layout's group order).
        q, k, v = (ctx.layout.join_local([qkv["txt"][i], qkv["img"][i]]) for i in range(3))
        attn_txt, attn_img = ctx.layout.split_after(_attend(q, k, v, angles, ctx), TEXT)
        out = {}
        for name, attn in (("txt", attn_txt), ("img", attn_img)):
            _, _, gate1, shift2, scale2, gate2 = mods[name]
            x = streams[name] + gate1[:, None] * getattr(self, f"{name}_proj")(attn, ctx)
            mlp_in = modulate(x, shift2, scale2, self.eps).astype(dtype)
            out[name] = x + gate2[:, None] * getattr(self, f"{name}_mlp")(mlp_in, ctx)
        return out["txt"], out["img"]


class SingleStreamBlock(nnx.Module):
    """Parallel attention + SwiGLU MLP on the joined sequence (diffusers ``Flux2SingleTransformerBlock``,
    arXiv 2302.05442). diffusers' fused ``to_qkv_mlp_proj`` is held as q, k, v, ``mlp_gate`` and
    ``mlp_value``; ``to_out`` as ``out_attn`` and ``out_mlp``, whose partial sums share one all-reduce."""

    def __init__(self, cfg: Flux2Config, *, dtype: Any, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.mlp_hidden
        self.attn = QKNormProjection(cfg, dtype=dtype, rngs=rngs)
        self.mlp_gate = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype, bias=False)
        self.mlp_value = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype, bias=False)
        self.out_attn = Linear(e, e, ("heads", "embed"), rngs=rngs, dtype=dtype, bias=False)
        self.out_mlp = Linear(f, e, ("mlp", "embed"), rngs=rngs, dtype=dtype, bias=False)
        self.eps = cfg.eps

    def __call__(self, x: jax.Array, mod: jax.Array, angles: jax.Array, ctx: ShardContext) -> jax.Array:
        """x [B, T+N, E] fp32 (this shard's [text; image]); mod [B, 3E] the stack's shared (shift, scale,
        gate); returns the updated stream."""
        dtype = self.mlp_gate.dtype
        shift, scale, gate = jnp.split(mod, 3, axis=-1)
        h = modulate(x, shift, scale, self.eps).astype(dtype)
        q, k, v = self.attn(h)
        attn = _attend(q, k, v, angles, ctx)
        mlp = swiglu(self.mlp_gate(h), self.mlp_value(h))
        # Row-parallel over both halves of to_out's input: add the partial sums, then one all-reduce.
        partial = self.out_attn.partial_sum(attn, ctx) + self.out_mlp.partial_sum(mlp, ctx)
        return x + gate[:, None] * ctx.sum_tensor_parallel(partial)
