"""FLUX.1 [dev] and [schnell] rectified-flow transformer in Flax NNX, written as the local view of one shard.

Follows Black Forest Labs' reference (``src/flux/model.py`` and ``modules/layers.py`` of
black-forest-labs/flux) and diffusers' ``FluxTransformer2DModel`` (they differ in naming and in the
final layer's (shift, scale) order, not in what they compute). Parameters are named after BFL's modules; the FLUX.1 checkpoint keys
map onto them in ``converters/flux.py``.

Shape letters: B batch, T text tokens, N image tokens, L = T + N joint tokens (all local to one sequence
shard inside ``shard_map``), H heads, D head_dim, E hidden, F MLP hidden.

Parallel plan (model code never names a mesh axis; it calls the :class:`ShardContext`):

- Text and image tokens are two token groups of the :class:`SequenceLayout`, sequence-sharded over
  (ring, ulysses) and padded when the degrees do not divide them. Shard r holds ``[text_r; image_r]``: the
  double blocks join the two streams' q/k/v per shard for joint attention, the single blocks carry the
  joined ``[text_r; image_r]`` sequence. Nothing is concatenated globally.
- Every op but attention is per token, RoPE included (each token brings its own (index, row, col) id,
  padded with the tokens), so only ``ctx.attention`` communicates over the sequence axes.
- Tensor parallel (Megatron): q/k/v and the MLP's first projection are column-parallel (logical "heads" /
  "mlp" on their output features), the attention output and MLP-down projections row-parallel with one
  all-reduce after each. A single block's ``linear2`` reads ``[attention ‖ MLP]`` features; it is split
  into an attention part and an MLP part whose partial sums are added before ONE all-reduce.
- AdaLN modulation (and the time/guidance/pooled-text embedders feeding it) stays replicated: it is
  computed once per step from a [B, E] vector, so splitting it would add a collective per block and save
  nothing worth having. The QK-norm scales are per head_dim, shared by all heads, hence replicated too.

Precision: weights and matmuls in the model's ``dtype`` (bf16 on GPU) with fp32 accumulation; the
residual streams, LayerNorm/RMSNorm, RoPE, AdaLN modulation and the softmax statistics in fp32.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxdit.mesh import ParallelConfig
from jaxdit.models import partitioning
from jaxdit.models.layers import (
    Linear,
    apply_rope,
    gelu_tanh,
    layer_norm,
    param,
    rms_norm,
    rope_angles,
    timestep_embedding,
)
from jaxdit.models.sharded_forward import Arg, ShardedForward
from jaxdit.models.staged import staged_forward
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.layout import SequenceLayout

#: Width of the sinusoidal embedding of the timestep and the guidance scale.
TIME_FREQ_DIM = 256
#: Both models multiply sigma in [0, 1] (and the guidance scale) by this before embedding it.
TIME_SCALE = 1000.0
#: Token groups of the joint sequence, in the order every shard holds them.
TEXT, IMAGE = 0, 1


# --------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FluxConfig:
    """Hyper-parameters of a FLUX.1 transformer (BFL's ``FluxParams`` names)."""

    in_channels: int = 64
    out_channels: int = 64  # features per output token (diffusers: patch_size**2 * out_channels)
    vec_in_dim: int = 768  # CLIP-L pooled embedding
    context_in_dim: int = 4096  # T5-XXL token embedding
    hidden_size: int = 3072
    num_heads: int = 24
    depth: int = 19  # double-stream blocks
    depth_single_blocks: int = 38
    mlp_ratio: float = 4.0
    axes_dim: tuple[int, ...] = (16, 56, 56)  # RoPE dims of (index, row, col); sums to head_dim
    theta: float = 10000.0
    qkv_bias: bool = True
    guidance_embed: bool = False  # dev: True (distilled guidance input), schnell: False

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "flux-dev": {"guidance_embed": True},
        "flux-schnell": {"guidance_embed": False},
    }

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dim", tuple(int(a) for a in self.axes_dim))
        for name in (
            "in_channels",
            "out_channels",
            "vec_in_dim",
            "context_in_dim",
            "hidden_size",
            "num_heads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"FluxConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.depth < 0 or self.depth_single_blocks < 0:
            raise ValueError(f"negative depth: {self.depth} double, {self.depth_single_blocks} single blocks")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if sum(self.axes_dim) != self.head_dim or any(a % 2 for a in self.axes_dim):
            raise ValueError(
                f"RoPE axes_dim {self.axes_dim} must be even and sum to head_dim "
                f"{self.hidden_size} / {self.num_heads} = {self.head_dim}"
            )
        if self.mlp_hidden < 1:
            raise ValueError(f"mlp_ratio {self.mlp_ratio} gives an empty MLP")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> FluxConfig:
        """``"flux-dev"`` or ``"flux-schnell"`` (full size), optionally with fields overridden."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown FLUX preset {name!r}; known: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> FluxConfig:
        """From a diffusers ``FluxTransformer2DModel`` ``config.json`` (a path or the parsed dict)."""
        if not isinstance(config, Mapping):
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        c = dict(config)
        known = {"FluxTransformer2DModel", None}
        if c.get("_class_name") not in known:
            raise ValueError(f"config is for {c.get('_class_name')!r}, not FluxTransformer2DModel")
        patch = int(c.get("patch_size", 1))
        heads = int(c.get("num_attention_heads", 24))
        head_dim = int(c.get("attention_head_dim", 128))
        in_channels = int(c.get("in_channels", 64))
        out_channels = c.get("out_channels") or in_channels
        return cls(
            in_channels=in_channels,
            out_channels=patch * patch * int(out_channels),
            vec_in_dim=int(c.get("pooled_projection_dim", 768)),
            context_in_dim=int(c.get("joint_attention_dim", 4096)),
            hidden_size=heads * head_dim,
            num_heads=heads,
            depth=int(c.get("num_layers", 19)),
            depth_single_blocks=int(c.get("num_single_layers", 38)),
            axes_dim=tuple(c.get("axes_dims_rope", (16, 56, 56))),
            guidance_embed=bool(c.get("guidance_embeds", False)),
            # diffusers fixes the MLP ratio at 4; a jaxdit-written config may carry another one.
            mlp_ratio=float(c.get("mlp_ratio", 4.0)),
        )

    @classmethod
    def from_bfl_keys(cls, shapes: Mapping[str, tuple[int, ...]], **overrides: Any) -> FluxConfig:
        """Inferred from a BFL state dict's key -> shape map (keys without any ``model.diffusion_model.``
        prefix), as BFL's and diffusers' single-file loaders do.

        The RoPE split is not stored in the weights: it is FLUX.1's (16, 56, 56) for head_dim 128 and must
        be passed as ``axes_dim=`` otherwise.
        """

        def shape(key: str) -> tuple[int, ...]:
            if key not in shapes:
                raise KeyError(f"cannot infer the FLUX config: no tensor {key!r}")
            return tuple(shapes[key])

        def count(prefix: str) -> int:
            idx = {int(k[len(prefix) :].split(".", 1)[0]) for k in shapes if k.startswith(prefix)}
            return max(idx) + 1 if idx else 0

        hidden, in_channels = shape("img_in.weight")
        depth = count("double_blocks.")
        norm_key = (
            "double_blocks.0.img_attn.norm.query_norm.scale"
            if depth
            else "single_blocks.0.norm.query_norm.scale"
        )
        head_dim = shape(norm_key)[0]
        mlp = (
            shape("double_blocks.0.img_mlp.0.weight")[0]
            if depth
            else shape("single_blocks.0.linear1.weight")[0] - 3 * hidden
        )
        fields: dict[str, Any] = dict(
            in_channels=in_channels,
            out_channels=shape("final_layer.linear.weight")[0],
            vec_in_dim=shape("vector_in.in_layer.weight")[1],
            context_in_dim=shape("txt_in.weight")[1],
            hidden_size=hidden,
            num_heads=hidden // head_dim,
            depth=depth,
            depth_single_blocks=count("single_blocks."),
            mlp_ratio=mlp / hidden,
            qkv_bias=(not depth) or "double_blocks.0.img_attn.qkv.bias" in shapes,
            guidance_embed="guidance_in.in_layer.weight" in shapes,
        )
        fields.update(overrides)
        if "axes_dim" not in fields:
            if head_dim != 128:
                raise ValueError(
                    f"head_dim is {head_dim}: the RoPE axes split cannot be inferred from the weights "
                    "(FLUX.1 uses (16, 56, 56) for head_dim 128); pass axes_dim= or a config"
                )
            fields["axes_dim"] = (16, 56, 56)
        return cls(**fields)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FluxConfig:
        return cls(**{k: (tuple(v) if k == "axes_dim" else v) for k, v in data.items()})


# --------------------------------------------------------------------------------------------------------
# Modules (local view)
# --------------------------------------------------------------------------------------------------------


def _fp32_out(layer: Linear, x: jax.Array) -> jax.Array:
    """A replicated Linear whose result stays fp32 (modulation): matmul in the weights' dtype, fp32 sum."""
    kernel = layer.kernel[...]
    y = jnp.einsum("...i,io->...o", x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
    return y if layer.bias is None else y + layer.bias[...].astype(jnp.float32)


def _partial_sum(layer: Linear, x: jax.Array) -> jax.Array:
    """x @ kernel in fp32 without bias or all-reduce: one term of a row-parallel sum."""
    kernel = layer.kernel[...]
    return jnp.einsum("...i,io->...o", x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)


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
        dtype = self.img_proj.kernel.dtype
        streams = {"txt": txt, "img": img}
        mods, qkv = {}, {}
        for name, x in streams.items():
            mod = _fp32_out(getattr(self, f"{name}_mod"), jax.nn.silu(vec))
            mods[name] = jnp.split(mod, 6, axis=-1)
            shift, scale = mods[name][0], mods[name][1]
            qkv[name] = getattr(self, f"{name}_attn")(_modulate(x, shift, scale).astype(dtype))
        # Joint attention over [text; image], joined per shard only (the layout's group order).
        q, k, v = (ctx.layout.join_local([qkv["txt"][i], qkv["img"][i]]) for i in range(3))
        attn_txt, attn_img = ctx.layout.split_local(_attend(q, k, v, angles, ctx))
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
        dtype = self.mlp_in.kernel.dtype
        shift, scale, gate = jnp.split(_fp32_out(self.modulation, jax.nn.silu(vec)), 3, axis=-1)
        h = _modulate(x, shift, scale).astype(dtype)
        q, k, v = self.attn(h)
        attn = _attend(q, k, v, angles, ctx)
        mlp = gelu_tanh(self.mlp_in(h).astype(jnp.float32))
        # Row-parallel over both halves of linear2's input: add the partial sums, then one all-reduce.
        partial = _partial_sum(self.out_attn, attn) + _partial_sum(self.out_mlp, mlp)
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
        return self.linear(_modulate(x, shift, scale).astype(self.linear.kernel.dtype))


def _stack(make, n: int, rngs: nnx.Rngs):
    """``n`` blocks with a leading layer axis on every parameter, each from its own RNG stream."""
    if n == 0:
        return None

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r: nnx.Rngs):
        return make(r)

    return build(rngs)


class FluxCond(NamedTuple):
    """What every FLUX block reads besides the streams: the AdaLN vector and the RoPE angles."""

    vec: jax.Array  # [B, E] fp32: time + guidance + pooled text
    angles: jax.Array  # [1, T+N, D/2] fp32: this shard's [text; image] positions, shared by the batch


class FluxTransformer(nnx.Module):
    """FLUX.1 transformer, a staged forward (``jaxdit.models.staged``): embed -> double blocks on the
    (text, image) streams -> single blocks on the joined stream -> final layer on the image tokens.

    Everything is the local view of one shard (see the module docstring); ``__call__`` is the whole
    forward, ``jaxdit.models.sharded_forward`` wraps it in ``shard_map`` and ``jaxdit.load_transformer``
    in a diffusers-style callable.
    """

    STACKS = ("double_blocks", "single_blocks")

    def __init__(self, config: FluxConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        cfg = config
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        e = cfg.hidden_size
        self.config = cfg
        self.img_in = Linear(cfg.in_channels, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.txt_in = Linear(cfg.context_in_dim, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.time_in = MLPEmbedder(TIME_FREQ_DIM, e, dtype=dtype, rngs=rngs)
        self.vector_in = MLPEmbedder(cfg.vec_in_dim, e, dtype=dtype, rngs=rngs)
        self.guidance_in = (
            MLPEmbedder(TIME_FREQ_DIM, e, dtype=dtype, rngs=rngs) if cfg.guidance_embed else None
        )
        self.double_blocks = _stack(lambda r: DoubleStreamBlock(cfg, dtype=dtype, rngs=r), cfg.depth, rngs)
        self.single_blocks = _stack(
            lambda r: SingleStreamBlock(cfg, dtype=dtype, rngs=r), cfg.depth_single_blocks, rngs
        )
        self.final_layer = LastLayer(cfg, dtype=dtype, rngs=rngs)

    @property
    def dtype(self) -> Any:
        return self.img_in.kernel.dtype

    def conditioning(self, timestep: jax.Array, pooled: jax.Array, guidance: jax.Array | None) -> jax.Array:
        """vec [B, E]: time + guidance + pooled-text embeddings (replicated: computed once per step)."""
        vec = self.time_in(timestep_embedding(timestep * TIME_SCALE, TIME_FREQ_DIM))
        if self.guidance_in is not None:
            if guidance is None:
                raise ValueError("this FLUX model embeds the guidance scale (dev): pass guidance=")
            vec = vec + self.guidance_in(timestep_embedding(guidance * TIME_SCALE, TIME_FREQ_DIM))
        elif guidance is not None:
            raise ValueError("this FLUX model has no guidance embedding (schnell); pass guidance=None")
        return vec + self.vector_in(pooled)

    # ------------------------------------------------------------------ staged forward
    def embed(self, inputs: Mapping[str, jax.Array], ctx: ShardContext) -> tuple[Any, FluxCond]:
        """diffusers-named inputs (:data:`FORWARD_INPUTS`) -> the fp32 (text, image) streams and the
        conditioning every block reads."""
        cfg = self.config
        vec = self.conditioning(
            inputs["timestep"].astype(jnp.float32), inputs["pooled_projections"], inputs.get("guidance")
        )
        ids = ctx.layout.join_local([inputs["txt_ids"], inputs["img_ids"]], axis=0)
        angles = rope_angles(ids, cfg.axes_dim, cfg.theta)[None]  # [1, T+N, D/2], shared by the batch
        return self.embed_tokens(inputs["hidden_states"], inputs["encoder_hidden_states"]), FluxCond(
            vec, angles
        )

    def embed_tokens(self, img: jax.Array, txt: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Packed latents [B, N, C] and T5 tokens [B, T, C'] -> the fp32 (text, image) residual streams."""
        return self.txt_in(txt).astype(jnp.float32), self.img_in(img).astype(jnp.float32)

    def enter(self, stack: str, streams: Any, ctx: ShardContext) -> Any:
        """The single blocks carry the joined per-shard [text; image] stream."""
        if stack == "single_blocks":
            return ctx.layout.join_local(list(streams))
        return streams

    def run_block(
        self, stack: str, block: nnx.Module, streams: Any, cond: FluxCond, ctx: ShardContext
    ) -> Any:
        if stack == "double_blocks":
            return block(streams[0], streams[1], cond.vec, cond.angles, ctx)
        return block(streams, cond.vec, cond.angles, ctx)

    def output(self, streams: jax.Array, cond: FluxCond, ctx: ShardContext) -> jax.Array:
        """The joined stream's image tokens -> the velocity prediction [B, N, out_channels]."""
        return self.final_layer(ctx.layout.split_local(streams)[IMAGE], cond.vec)

    # ------------------------------------------------------------------ feature-cache hooks (jaxdit.cache)
    #: TeaCache's input is computed in the step from the latents (jaxdit.cache.hooks.CacheHooks).
    TEACACHE_METRIC: ClassVar[str] = "step_input"

    def cache_metric_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """First-Block-Cache / DBCache compare the image stream (as diffusers' hook does): (it, its real
        tokens), from the (text, image) streams or the joined stream of the single blocks."""
        valid = ctx.layout.split_local(ctx.token_valid(), axis=0)[IMAGE]
        if isinstance(streams, tuple | list):
            return streams[IMAGE], valid
        return ctx.layout.split_local(streams)[IMAGE], valid

    def cache_output_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """MagCache measures the image tokens of the final (joined) stream, as MagCache4FLUX does."""
        return self.cache_metric_stream(streams, ctx)

    def teacache_input(
        self, block: DoubleStreamBlock, streams: Any, cond: FluxCond, ctx: ShardContext
    ) -> tuple[jax.Array, jax.Array]:
        """TeaCache's metric input: the first double block's modulated image input, LN(img) * (1 + scale1)
        + shift1 (TeaCache4FLUX's ``transformer_blocks[0].norm1``), and the image's real tokens."""
        shift, scale = jnp.split(_fp32_out(block.img_mod, jax.nn.silu(cond.vec)), 6, axis=-1)[:2]
        return _modulate(streams[IMAGE], shift, scale), self.cache_metric_stream(streams, ctx)[1]

    def teacache_timestep_input(self, timestep: jax.Array) -> jax.Array:
        raise NotImplementedError("FLUX's TeaCache input depends on the latents (teacache_input)")

    def magcache_defaults(self, grid: tuple[int, ...]) -> dict[str, Any] | None:
        """MagCache's ratios: the authors' FLUX.1-dev calibration (MagCache4FLUX, 28 steps, threshold
        0.24, K 5, retention 0.1), else jaxdit's shipped calibration of this architecture, else None.
        The authors publish none for FLUX.1-schnell."""
        from jaxdit.cache.magcache import config_key, shipped

        if self.config == FluxConfig.preset("flux-dev"):
            return shipped("flux-dev")
        return shipped(config_key("flux", self.config))

    def teacache_defaults(self, grid: tuple[int, ...]) -> tuple[tuple[float, ...], float]:
        """TeaCache4FLUX's rescaling polynomial (ali-vilab/TeaCache ``TeaCache4FLUX/teacache_flux.py``) and
        threshold 0.4 (1.8x on FLUX.1-dev as published; 0.25 / 0.6 / 0.8 give 1.5x / 2.0x / 2.25x)."""
        return (498.651651, -283.781631, 55.8554382, -3.82021401, 0.264230861), 0.4

    def __call__(
        self,
        img: jax.Array,
        txt: jax.Array,
        pooled: jax.Array,
        timestep: jax.Array,
        img_ids: jax.Array,
        txt_ids: jax.Array,
        guidance: jax.Array | None = None,
        *,
        ctx: ShardContext | None = None,
    ) -> jax.Array:
        """Local view: this shard's tokens -> its image tokens' velocity prediction.

        img [B, N, in_channels] packed latents, txt [B, T, context_in_dim], pooled [B, vec_in_dim],
        timestep [B] sigma in [0, 1], img_ids [N, 3], txt_ids [T, 3], guidance [B] or None. N and T are
        this shard's (padded) token counts from ``ctx.layout``; without ``ctx`` the call is the whole,
        unsharded model. Returns [B, N, out_channels] in the model's dtype.
        """
        if ctx is None:
            ctx = ShardContext(ParallelConfig(), SequenceLayout((txt.shape[1], img.shape[1]), 1))
        inputs = dict(
            hidden_states=img,
            encoder_hidden_states=txt,
            pooled_projections=pooled,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
        )
        return staged_forward(self, inputs, ctx)


def abstract_model(config: FluxConfig, dtype: Any = jnp.float32) -> FluxTransformer:
    """The model with ``jax.ShapeDtypeStruct`` parameters: shapes and logical axes, nothing allocated."""
    return nnx.eval_shape(lambda: FluxTransformer(config, dtype=dtype, rngs=nnx.Rngs(0)))


def parameter_shapes(config: FluxConfig) -> dict[str, tuple[int, ...]]:
    """Dotted parameter path -> shape (stacked blocks with their leading layer axis)."""
    return partitioning.parameter_shapes(abstract_model(config))


# --------------------------------------------------------------------------------------------------------
# On a mesh
# --------------------------------------------------------------------------------------------------------

#: How the forward's inputs lie on the mesh (diffusers' argument names). Text tokens are token group 0 and
#: image tokens group 1, so shard r holds [text_r; image_r]; the ids are padded with their tokens.
FORWARD_INPUTS: dict[str, Arg] = {
    "hidden_states": Arg(("batch", "seq", None), IMAGE),
    "encoder_hidden_states": Arg(("batch", "seq", None), TEXT, model_dtype=True),
    "pooled_projections": Arg(("batch", None), model_dtype=True),
    "timestep": Arg(("batch",)),
    "img_ids": Arg(("seq", None), IMAGE),
    "txt_ids": Arg(("seq", None), TEXT),
    "guidance": Arg(("batch",)),
}
FORWARD_OUTPUT = Arg(("batch", "seq", None), IMAGE)


def _forward_body(model: FluxTransformer, ctx: ShardContext, **x: jax.Array) -> jax.Array:
    return staged_forward(model, x, ctx)


def sharded(
    model: FluxTransformer,
    mesh: Mesh,
    *,
    rules: Mapping[str, object] | None = None,
    kernel: Mapping[str, int] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> ShardedForward:
    """The model's forward as one jitted ``shard_map`` over ``mesh``, called with diffusers' argument
    names on global arrays (see :data:`FORWARD_INPUTS`). ``model`` may be abstract
    (:func:`abstract_model`) for :meth:`ShardedForward.lower`."""
    return ShardedForward(
        model,
        mesh,
        inputs=FORWARD_INPUTS,
        output=FORWARD_OUTPUT,
        body=_forward_body,
        num_heads=model.config.num_heads,
        rules=rules,
        kernel=kernel,
        compiler_options=compiler_options,
    )
