"""FLUX.2 [dev] and [klein] rectified-flow transformer in Flax NNX, written as the local view of one shard.

As diffusers' ``Flux2Transformer2DModel`` defines it (``models/transformers/transformer_flux2.py``):
bias-free projections everywhere, a timestep (+ guidance, dev) embedding whose SiLU feeds three
modulation layers computed ONCE per step and shared by every block of their stack (image and text
modulation of the double blocks, one of the single blocks), 4-axis RoPE ids (time, row, column, text
position; ``flux2_config``), bias-free SwiGLU MLPs, and the final AdaLN in diffusers' (scale, shift)
order. Reference images for editing are clean packed latents joined along the image stream after the
denoised tokens, with their own time coordinates; only the denoised tokens are predicted.

Parallel plan, the same as FLUX.1's (``models/flux.py``): text, image and reference tokens are three
token groups of the :class:`SequenceLayout`, sequence-sharded over (ring, ulysses) with padding; every op
but attention is per token (RoPE included), so only ``ctx.attention`` communicates over the sequence
axes; tensor parallel splits heads and MLP units (``models/flux2_blocks.py``); the embeddings and the
shared modulation stay replicated (computed once per step from a [B, E] vector).

Precision: weights and matmuls in the model's ``dtype`` with fp32 accumulation; the residual streams,
norms, RoPE, modulation and softmax statistics in fp32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxdit.mesh import ParallelConfig
from jaxdit.models import partitioning
from jaxdit.models.flux2_blocks import DoubleStreamBlock, SingleStreamBlock
from jaxdit.models.flux2_cache_hooks import Flux2CacheHooks
from jaxdit.models.flux2_config import IMAGE, REFERENCE, TEXT, Flux2Config
from jaxdit.models.flux_blocks import _fp32_out, _stack
from jaxdit.models.layers import Linear, layer_norm, rope_angles, timestep_embedding
from jaxdit.models.sharded_forward import Arg, ShardedForward, sharded_staged
from jaxdit.models.staged import staged_forward
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.layout import SequenceLayout

#: The pipelines pass sigma in [0, 1]; the model embeds sigma (and the guidance scale) times this.
TIME_SCALE = 1000.0


class Flux2Cond(NamedTuple):
    """What every FLUX.2 block reads besides the streams: the step's embedding, the three shared
    modulation vectors (fp32) and the RoPE angles."""

    temb: jax.Array  # [B, E]: time (+ guidance)
    mod_img: jax.Array  # [B, 6E]: the double blocks' image modulation
    mod_txt: jax.Array  # [B, 6E]: the double blocks' text modulation
    mod_single: jax.Array  # [B, 3E]: the single blocks' modulation
    angles: jax.Array  # [1, T+N(+R), D/2]: this shard's [text; image; reference] positions


class StepCond(NamedTuple):
    """:class:`Flux2Cond` without the positions: what depends on the step alone."""

    temb: jax.Array
    mod_img: jax.Array
    mod_txt: jax.Array
    mod_single: jax.Array


class Embedder(nnx.Module):
    """Bias-free Linear -> SiLU -> Linear on a sinusoidal embedding (diffusers ``TimestepEmbedding``)."""

    def __init__(self, d_in: int, hidden: int, *, dtype: Any, rngs: nnx.Rngs):
        self.linear_1 = Linear(d_in, hidden, ("in_features", "embed"), rngs=rngs, dtype=dtype, bias=False)
        self.linear_2 = Linear(hidden, hidden, ("embed", "embed_out"), rngs=rngs, dtype=dtype, bias=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _fp32_out(self.linear_2, jax.nn.silu(_fp32_out(self.linear_1, x)))


def _modulation(e: int, sets: int, *, dtype: Any, rngs: nnx.Rngs) -> Linear:
    return Linear(e, 3 * sets * e, ("embed", "modulation"), rngs=rngs, dtype=dtype, bias=False)


class Flux2Transformer(Flux2CacheHooks, nnx.Module):
    """FLUX.2 transformer, a staged forward (``jaxdit.models.staged``): embed -> double blocks on the
    (text, image) streams -> single blocks on the joined stream -> final layer on the image tokens.

    Everything is the local view of one shard; ``__call__`` is the whole forward and :func:`sharded`
    wraps it in ``shard_map``. The feature caches' hooks are ``flux2_cache_hooks``'.
    """

    STACKS = ("double_blocks", "single_blocks")

    def __init__(self, config: Flux2Config, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        cfg = config
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        e = cfg.hidden_size
        self.config = cfg
        self.img_in = Linear(cfg.in_channels, e, ("in_features", "embed"), rngs=rngs, dtype=dtype, bias=False)
        self.txt_in = Linear(
            cfg.joint_attention_dim, e, ("in_features", "embed"), rngs=rngs, dtype=dtype, bias=False
        )
        channels = cfg.timestep_guidance_channels
        self.time_in = Embedder(channels, e, dtype=dtype, rngs=rngs)
        self.guidance_in = Embedder(channels, e, dtype=dtype, rngs=rngs) if cfg.guidance_embeds else None
        self.double_mod_img = _modulation(e, 2, dtype=dtype, rngs=rngs)
        self.double_mod_txt = _modulation(e, 2, dtype=dtype, rngs=rngs)
        self.single_mod = _modulation(e, 1, dtype=dtype, rngs=rngs)
        self.double_blocks = _stack(
            lambda r: DoubleStreamBlock(cfg, dtype=dtype, rngs=r), cfg.num_layers, rngs
        )
        self.single_blocks = _stack(
            lambda r: SingleStreamBlock(cfg, dtype=dtype, rngs=r), cfg.num_single_layers, rngs
        )
        # AdaLayerNormContinuous: (scale, shift), diffusers' order.
        self.norm_out = Linear(e, 2 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype, bias=False)
        self.proj_out = Linear(
            e, cfg.output_features, ("embed", "out_features"), rngs=rngs, dtype=dtype, bias=False
        )

    @property
    def dtype(self) -> Any:
        return self.img_in.kernel.dtype

    def time_embedding(self, timestep: jax.Array, guidance: jax.Array | None) -> jax.Array:
        """temb [B, E] fp32: the time (+ guidance) embedding, replicated (computed once per step)."""
        channels = self.config.timestep_guidance_channels
        temb = self.time_in(timestep_embedding(timestep.astype(jnp.float32) * TIME_SCALE, channels))
        if self.guidance_in is not None:
            if guidance is None:
                raise ValueError("this FLUX.2 model embeds the guidance scale (dev): pass guidance=")
            g = timestep_embedding(guidance.astype(jnp.float32) * TIME_SCALE, channels)
            temb = temb + self.guidance_in(g)
        elif guidance is not None:
            raise ValueError("this FLUX.2 model has no guidance embedding (klein); pass guidance=None")
        return temb

    def step_conditioning(self, timestep: jax.Array, guidance: jax.Array | None) -> StepCond:
        """The step's embedding and the three shared modulations (replicated: once per step)."""
        temb = self.time_embedding(timestep, guidance)
        act = jax.nn.silu(temb)
        return StepCond(
            temb,
            _fp32_out(self.double_mod_img, act),
            _fp32_out(self.double_mod_txt, act),
            _fp32_out(self.single_mod, act),
        )

    def embed_tokens(
        self, img: jax.Array, txt: jax.Array, ref: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Packed latents [B, N, C], text features [B, T, C'] and packed reference latents [B, R, C] (or
        None) -> the fp32 (text, image) residual streams; the image stream is this shard's [image;
        reference]."""
        img = img if ref is None else jnp.concatenate([img, ref.astype(img.dtype)], axis=1)
        return self.txt_in(txt).astype(jnp.float32), self.img_in(img).astype(jnp.float32)

    def angles(self, ids: jax.Array) -> jax.Array:
        """RoPE angles [..., D/2] of 4-axis position ids [..., 4]."""
        return rope_angles(ids, self.config.axes_dims_rope, self.config.rope_theta)

    # ------------------------------------------------------------------ staged forward
    def embed(self, inputs: Mapping[str, jax.Array], ctx: ShardContext) -> tuple[Any, Flux2Cond]:
        """diffusers-named inputs (:data:`FORWARD_INPUTS`) -> the fp32 (text, image) streams and the
        conditioning every block reads."""
        step = self.step_conditioning(inputs["timestep"], inputs.get("guidance"))
        ids = [inputs.get(name) for name in ("txt_ids", "img_ids", "reference_ids")]
        angles = self.angles(ctx.layout.join_local([i for i in ids if i is not None], axis=0))
        streams = self.embed_tokens(
            inputs["hidden_states"], inputs["encoder_hidden_states"], inputs.get("reference_hidden_states")
        )
        return streams, Flux2Cond(*step, angles[None])

    def enter(self, stack: str, streams: Any, ctx: ShardContext) -> Any:
        """The single blocks carry the joined per-shard [text; image] stream."""
        if stack == "single_blocks":
            return ctx.layout.join_local(list(streams))
        return streams

    def run_block(
        self, stack: str, block: nnx.Module, streams: Any, cond: Flux2Cond, ctx: ShardContext
    ) -> Any:
        if stack == "double_blocks":
            return block(streams[0], streams[1], cond.mod_txt, cond.mod_img, cond.angles, ctx)
        return block(streams, cond.mod_single, cond.angles, ctx)

    def output(self, streams: jax.Array, cond: Flux2Cond, ctx: ShardContext) -> jax.Array:
        """The joined stream's image tokens -> the velocity prediction [B, N, output_features]."""
        scale, shift = jnp.split(_fp32_out(self.norm_out, jax.nn.silu(cond.temb)), 2, axis=-1)
        x = ctx.layout.split_local(streams)[IMAGE]
        x = layer_norm(x, self.config.eps) * (1.0 + scale[:, None]) + shift[:, None]
        return self.proj_out(x.astype(self.dtype))

    def __call__(
        self,
        hidden_states: jax.Array,
        encoder_hidden_states: jax.Array,
        timestep: jax.Array,
        img_ids: jax.Array,
        txt_ids: jax.Array,
        guidance: jax.Array | None = None,
        *,
        ctx: ShardContext | None = None,
    ) -> jax.Array:
        """Local view: this shard's tokens -> its image tokens' velocity prediction.

        hidden_states [B, N, in_channels] packed latents, encoder_hidden_states [B, T,
        joint_attention_dim], timestep [B] sigma in [0, 1], img_ids [N, 4], txt_ids [T, 4], guidance [B]
        (dev) or None (klein). Without ``ctx`` the call is the whole, unsharded model. Returns
        [B, N, output_features] in the model's dtype.
        """
        if ctx is None:
            ctx = ShardContext(
                ParallelConfig(), SequenceLayout((encoder_hidden_states.shape[1], hidden_states.shape[1]), 1)
            )
        inputs = dict(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
        )
        return staged_forward(self, inputs, ctx)


def abstract_model(config: Flux2Config, dtype: Any = jnp.float32) -> Flux2Transformer:
    """The model with ``jax.ShapeDtypeStruct`` parameters: shapes and logical axes, nothing allocated."""
    return nnx.eval_shape(lambda: Flux2Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))


def parameter_shapes(config: Flux2Config) -> dict[str, tuple[int, ...]]:
    """Dotted parameter path -> shape (stacked blocks with their leading layer axis)."""
    return partitioning.parameter_shapes(abstract_model(config))


# --------------------------------------------------------------------------------------------------------
# On a mesh
# --------------------------------------------------------------------------------------------------------

#: How the forward's inputs lie on the mesh (diffusers' argument names, ids [L, 4] without a batch axis).
#: Text is token group 0, the denoised image group 1 and the reference images group 2, so shard r holds
#: [text_r; image_r; reference_r]; the ids (and an optional text key mask) are padded with their tokens.
FORWARD_INPUTS: dict[str, Arg] = {
    "hidden_states": Arg(("batch", "seq", None), IMAGE),
    "encoder_hidden_states": Arg(("batch", "seq", None), TEXT, model_dtype=True),
    "timestep": Arg(("batch",)),
    "img_ids": Arg(("seq", None), IMAGE),
    "txt_ids": Arg(("seq", None), TEXT),
    "guidance": Arg(("batch",)),
    # Reference images for editing: clean packed latents and their ids (``flux2_config.reference_ids``),
    # never denoised; diffusers passes them appended to hidden_states / img_ids.
    "reference_hidden_states": Arg(("batch", "seq", None), REFERENCE, model_dtype=True),
    "reference_ids": Arg(("seq", None), REFERENCE),
    # Optional: each prompt's real text tokens (True); masked tokens are no key of any attention. diffusers'
    # FLUX.2 pipelines pad every prompt to max_sequence_length and attend to all of it (no mask).
    "encoder_attention_mask": Arg(("batch", "seq"), TEXT, key_mask=True),
}
FORWARD_OUTPUT = Arg(("batch", "seq", None), IMAGE)


def sharded(
    model: Flux2Transformer,
    mesh: Mesh,
    *,
    rules: Mapping[str, object] | None = None,
    kernel: Mapping[str, int] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> ShardedForward:
    """The model's forward as one jitted ``shard_map`` over ``mesh``, called with diffusers' argument
    names on global arrays (see :data:`FORWARD_INPUTS`); ``model`` may be abstract for ``lower``."""
    return sharded_staged(
        model,
        mesh,
        FORWARD_INPUTS,
        FORWARD_OUTPUT,
        rules=rules,
        kernel=kernel,
        compiler_options=compiler_options,
    )
