"""FLUX.1 [dev] and [schnell] rectified-flow transformer in Flax NNX, written as the local view of one shard.

Follows Black Forest Labs' reference (``src/flux/model.py`` and ``modules/layers.py`` of
black-forest-labs/flux) and diffusers' ``FluxTransformer2DModel`` (they differ in naming and in the
final layer's (shift, scale) order, not in what they compute). Parameters are named after BFL's modules; the FLUX.1 checkpoint keys
map onto them in ``converters/flux.py``.

Shape letters: B batch, T text tokens, N image tokens, L = T + N joint tokens (all local to one sequence
shard inside ``shard_map``), H heads, D head_dim, E hidden, F MLP hidden.

Parallel plan (model code never names a mesh axis; it calls the :class:`ShardContext`):

- Text and image tokens are two token groups of the :class:`SequenceLayout` (reference images, FLUX.1
  Kontext's, a third one that rides in the image stream), sequence-sharded over (ring, ulysses) and
  padded when the degrees do not divide them. Shard r holds ``[text_r; image_r]``: the
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

from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxdit.mesh import ParallelConfig
from jaxdit.models import partitioning
from jaxdit.models.flux_blocks import (
    DoubleStreamBlock,
    LastLayer,
    MLPEmbedder,
    SingleStreamBlock,
    _fp32_out,
    _modulate,
    _stack,
)
from jaxdit.models.flux_config import IMAGE, REFERENCE, TEXT, FluxConfig
from jaxdit.models.layers import (
    Linear,
    rope_angles,
    timestep_embedding,
)
from jaxdit.models.sharded_forward import Arg, ShardedForward, sharded_staged
from jaxdit.models.staged import staged_forward
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.layout import SequenceLayout

#: Width of the sinusoidal embedding of the timestep and the guidance scale.
TIME_FREQ_DIM = 256
#: Both models multiply sigma in [0, 1] (and the guidance scale) by this before embedding it.
TIME_SCALE = 1000.0


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
        ids = [inputs.get(name) for name in ("txt_ids", "img_ids", "reference_ids")]
        angles = rope_angles(
            ctx.layout.join_local([i for i in ids if i is not None], axis=0), cfg.axes_dim, cfg.theta
        )
        streams = self.embed_tokens(
            inputs["hidden_states"], inputs["encoder_hidden_states"], inputs.get("reference_hidden_states")
        )
        return streams, FluxCond(vec, angles[None])  # angles [1, T+N(+R), D/2], shared by the batch

    def embed_tokens(
        self, img: jax.Array, txt: jax.Array, ref: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Packed latents [B, N, C], T5 tokens [B, T, C'] and packed reference latents [B, R, C] (or None)
        -> the fp32 (text, image) residual streams; the image stream is this shard's [image; reference]."""
        img = img if ref is None else jnp.concatenate([img, ref.astype(img.dtype)], axis=1)
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
        """First-Block-Cache / DBCache compare the image stream (as diffusers' hook does; with reference
        images, the image stream carries them too): (it, its real tokens), from the (text, image) streams
        of the double blocks or the joined stream of the single blocks."""
        valid = ctx.layout.split_after(ctx.token_valid(), TEXT, axis=0)[1]
        if isinstance(streams, tuple | list):
            return streams[IMAGE], valid
        return ctx.layout.split_after(streams, TEXT)[1], valid

    def cache_output_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """MagCache measures the image tokens of the final (joined) stream, as MagCache4FLUX does."""
        valid = ctx.layout.split_local(ctx.token_valid(), axis=0)[IMAGE]
        return ctx.layout.split_local(streams)[IMAGE], valid

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
        """MagCache's ratios: the authors' calibration of FLUX.1-dev (MagCache4FLUX, 28 steps, threshold
        0.24, K 5, retention 0.1) or FLUX.1-schnell (4 steps), else jaxdit's shipped calibration of this
        architecture (tiny-digits), else None. FLUX.1 Kontext [dev] has FLUX.1-dev's architecture and
        takes its ratios by default; its own are ``MagCache(ratios="flux-kontext-dev")``."""
        from jaxdit.cache.magcache import config_key, shipped

        for preset in ("flux-dev", "flux-schnell"):
            if self.config == FluxConfig.preset(preset):
                return shipped(preset)
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
#: image tokens group 1, so shard r holds [text_r; image_r]; the ids (and a text key mask) are padded with
#: their tokens.
FORWARD_INPUTS: dict[str, Arg] = {
    "hidden_states": Arg(("batch", "seq", None), IMAGE),
    "encoder_hidden_states": Arg(("batch", "seq", None), TEXT, model_dtype=True),
    "pooled_projections": Arg(("batch", None), model_dtype=True),
    "timestep": Arg(("batch",)),
    "img_ids": Arg(("seq", None), IMAGE),
    "txt_ids": Arg(("seq", None), TEXT),
    "guidance": Arg(("batch",)),
    # Kontext's reference image: clean packed latents and their ids, never denoised (absent for FLUX.1).
    "reference_hidden_states": Arg(("batch", "seq", None), REFERENCE, model_dtype=True),
    "reference_ids": Arg(("seq", None), REFERENCE),
    # Optional: each prompt's real T5 tokens (True), for callers that pass prompts of different lengths
    # unpadded-by-meaning; the masked text tokens are then no key of any attention. Left out (diffusers'
    # FLUX: every prompt padded to max_sequence_length and attended in full), nothing is masked.
    "encoder_attention_mask": Arg(("batch", "seq"), TEXT, key_mask=True),
}
FORWARD_OUTPUT = Arg(("batch", "seq", None), IMAGE)


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
    return sharded_staged(
        model,
        mesh,
        FORWARD_INPUTS,
        FORWARD_OUTPUT,
        rules=rules,
        kernel=kernel,
        compiler_options=compiler_options,
    )
