"""The toy family's transformer: a tiny single-stream DiT, written as the local view of one shard.

Text tokens (prompt embeddings [B, T, text_dim]) and image tokens (latents [B, C, h, w] as one token per
latent pixel) are two token groups of the shard-major layout (``jaxdit.parallel.layout``); every block
runs on the joined per-shard ``[text_r; image_r]`` stream: AdaLN from the timestep, 2-D RoPE from each
token's own (row, col) position, self-attention through ``ctx.attention`` (Ulysses / Ring / USP and the
key mask of the padding come from there), a GELU MLP. Tensor parallel as Megatron: q/k/v and the MLP's
first layer split over heads / MLP features ("heads", "mlp" logical axes), the attention output and the
MLP's second layer row-parallel with one all-reduce each. The model never names a mesh axis.

It is a staged model (``jaxdit.models.staged``: ``STACKS`` / ``embed`` / ``enter`` / ``run_block`` /
``output``), so the shared sharded forward, feature caches and LoRA find its blocks. It gives First-Block-Cache
its metric stream (:meth:`ToyTransformer.cache_metric_stream`), not TeaCache's input, and has no PipeFusion
stage layout (the family says so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxdit.models.layers import Linear, apply_rope, gelu_tanh, layer_norm, rope_angles, timestep_embedding
from jaxdit.models.sharded_forward import Arg, ShardedForward
from jaxdit.models.staged import staged_forward
from jaxdit.parallel.context import ShardContext

#: Token groups, in the order every shard holds them.
TEXT, IMAGE = 0, 1
FREQ_DIM = 32  # sinusoidal timestep features
TIME_SCALE = 1000.0


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    in_channels: int = 4  # latent channels = features per image token (patch size 1)
    text_dim: int = 8
    hidden_size: int = 32
    num_heads: int = 4
    depth: int = 2
    mlp_ratio: float = 2.0
    axes_dim: tuple[int, ...] = (4, 4)  # RoPE dims of (row, col); sums to head_dim
    theta: float = 10000.0

    #: Named "full-size" models (the toy's are tiny); ``jaxdit plan`` and ``--model`` use them.
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "toy-small": {},
        "toy-wide": {"hidden_size": 64, "num_heads": 8, "axes_dim": (4, 4)},
    }

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dim", tuple(int(a) for a in self.axes_dim))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if sum(self.axes_dim) != self.head_dim or any(a % 2 for a in self.axes_dim):
            raise ValueError(
                f"RoPE axes_dim {self.axes_dim} must be even and sum to head_dim {self.head_dim}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ToyConfig:
        if name not in cls.PRESETS:
            raise ValueError(f"unknown toy preset {name!r}; known: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ToyConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if k == "axes_dim" else v) for k, v in data.items() if k in names})


def _heads(x: jax.Array, head_dim: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


def _modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    return layer_norm(x) * (1.0 + scale[:, None]) + shift[:, None]


class Block(nnx.Module):
    """AdaLN-zero-style block: modulated attention and MLP on the joined stream."""

    def __init__(self, cfg: ToyConfig, *, dtype: Any, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.mlp_hidden
        self.modulation = Linear(e, 6 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype)
        self.q = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.k = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.v = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.proj = Linear(e, e, ("heads", "embed"), rngs=rngs, dtype=dtype, row_parallel=True)
        self.fc1 = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.fc2 = Linear(f, e, ("mlp", "embed"), rngs=rngs, dtype=dtype, row_parallel=True)
        self.head_dim = cfg.head_dim

    def __call__(self, x: jax.Array, vec: jax.Array, angles: jax.Array, ctx: ShardContext) -> jax.Array:
        dtype = self.q.kernel.dtype
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(
            self.modulation(jax.nn.silu(vec)).astype(jnp.float32), 6, axis=-1
        )
        h = _modulate(x, shift1, scale1).astype(dtype)
        q = apply_rope(_heads(self.q(h), self.head_dim), angles).astype(dtype)
        k = apply_rope(_heads(self.k(h), self.head_dim), angles).astype(dtype)
        v = _heads(self.v(h), self.head_dim)
        attn = ctx.attention(q, k, v)
        x = x + gate1[:, None] * self.proj(attn.reshape(*attn.shape[:2], -1), ctx).astype(jnp.float32)
        h = _modulate(x, shift2, scale2).astype(dtype)
        mlp = self.fc2(gelu_tanh(self.fc1(h).astype(jnp.float32)), ctx)
        return x + gate2[:, None] * mlp.astype(jnp.float32)


def _stack(make, n: int, rngs: nnx.Rngs):
    """``n`` blocks with a leading layer axis on every parameter (``lax.scan`` runs them)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r: nnx.Rngs):
        return make(r)

    return build(rngs)


class ToyCond(NamedTuple):
    vec: jax.Array  # [B, E] fp32 timestep embedding
    angles: jax.Array  # [1, T+N, D/2] this shard's RoPE angles


class ToyTransformer(nnx.Module):
    STACKS = ("blocks",)

    def __init__(self, config: ToyConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        cfg, rngs = config, rngs if rngs is not None else nnx.Rngs(0)
        e = cfg.hidden_size
        self.config = cfg
        self.x_in = Linear(cfg.in_channels, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.txt_in = Linear(cfg.text_dim, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.t_in = Linear(FREQ_DIM, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.t_out = Linear(e, e, ("embed", "embed_out"), rngs=rngs, dtype=dtype)
        self.blocks = _stack(lambda r: Block(cfg, dtype=dtype, rngs=r), cfg.depth, rngs)
        self.out_mod = Linear(e, 2 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype)
        self.out = Linear(e, cfg.in_channels, ("embed", "out_features"), rngs=rngs, dtype=dtype)

    @property
    def dtype(self) -> Any:
        return self.x_in.kernel.dtype

    def embed(self, inputs: Mapping[str, jax.Array], ctx: ShardContext) -> tuple[Any, ToyCond]:
        cfg = self.config
        t = timestep_embedding(inputs["timestep"].astype(jnp.float32) * TIME_SCALE, FREQ_DIM)
        vec = self.t_out(jax.nn.silu(self.t_in(t).astype(jnp.float32))).astype(jnp.float32)
        positions = ctx.layout.join_local([inputs["txt_pos"], inputs["img_pos"]], axis=0)
        angles = rope_angles(positions, cfg.axes_dim, cfg.theta)[None]
        txt = self.txt_in(inputs["encoder_hidden_states"]).astype(jnp.float32)
        img = self.x_in(inputs["hidden_states"]).astype(jnp.float32)
        return (txt, img), ToyCond(vec, angles)

    def enter(self, stack: str, streams: Any, ctx: ShardContext) -> Any:
        return ctx.layout.join_local(list(streams))  # one stream: [text_r; image_r]

    def run_block(self, stack: str, block: Block, streams: Any, cond: ToyCond, ctx: ShardContext) -> Any:
        return block(streams, cond.vec, cond.angles, ctx)

    def output(self, streams: jax.Array, cond: ToyCond, ctx: ShardContext) -> jax.Array:
        img = ctx.layout.split_local(streams)[IMAGE]
        shift, scale = jnp.split(self.out_mod(jax.nn.silu(cond.vec)).astype(jnp.float32), 2, axis=-1)
        return self.out(_modulate(img, shift, scale).astype(self.dtype))

    # ------------------------------------------------------------------ feature-cache hook (jaxdit.cache)
    def cache_metric_stream(self, streams: jax.Array, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """First-Block-Cache compares the image tokens of the joined stream: (them, which are real)."""
        valid = ctx.layout.split_local(ctx.token_valid(), axis=0)[IMAGE]
        return ctx.layout.split_local(streams)[IMAGE], valid


def abstract_model(config: ToyConfig, dtype: Any = jnp.float32) -> ToyTransformer:
    return nnx.eval_shape(lambda: ToyTransformer(config, dtype=dtype, rngs=nnx.Rngs(0)))


#: How the forward's inputs lie on the mesh: "batch" over (data, cfg), "seq" over (ring, ulysses).
FORWARD_INPUTS: dict[str, Arg] = {
    "hidden_states": Arg(("batch", "seq", None), IMAGE),
    "encoder_hidden_states": Arg(("batch", "seq", None), TEXT, model_dtype=True),
    "timestep": Arg(("batch",)),
    "img_pos": Arg(("seq", None), IMAGE),
    "txt_pos": Arg(("seq", None), TEXT),
}
FORWARD_OUTPUT = Arg(("batch", "seq", None), IMAGE)


def _body(model: ToyTransformer, ctx: ShardContext, **x: jax.Array) -> jax.Array:
    return staged_forward(model, x, ctx)


def sharded(model: ToyTransformer, mesh: Mesh, **options: Any) -> ShardedForward:
    """The forward as one jitted ``shard_map`` over ``mesh`` (``options``: rules, kernel, compiler_options)."""
    return ShardedForward(
        model,
        mesh,
        inputs=FORWARD_INPUTS,
        output=FORWARD_OUTPUT,
        body=_body,
        num_heads=model.config.num_heads,
        **options,
    )
