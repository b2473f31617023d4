"""Qwen-Image's MMDiT (Qwen Team, arXiv 2508.02324) in Flax NNX, written as the local view of one shard.

Follows diffusers' ``QwenImageTransformer2DModel`` (``models/transformers/transformer_qwenimage.py``):
the text features (Qwen2.5-VL's last hidden state) pass an RMSNorm and a linear layer, the packed latents
a linear layer; ``num_layers`` dual-stream blocks attend jointly over [text; image] with the prompts' key
mask; the image tokens leave through an AdaLN (scale first) and a linear layer. The AdaLN vector is the
timestep's embedding alone (no pooled text, no guidance embedding). RoPE has three axes (frame, row,
column) with the image centred on 0 and the text on the diagonal past it
(:func:`~jaxdit.models.qwen_image_config.rope_positions`). Parameters keep diffusers' names; the
checkpoint keys map onto them in ``converters/qwen_image.py``.

Shape letters: B batch, T text tokens, N image tokens (local to one sequence shard inside
``shard_map``), H heads, D head_dim, E hidden.

Parallel plan (model code never names a mesh axis; it calls the :class:`ShardContext`):

- Text and image tokens are token groups 0 and 1 of the :class:`SequenceLayout`, sequence-sharded over
  (ring, ulysses) and padded where the degrees do not divide them; shard r holds [text_r; image_r] and
  nothing is concatenated globally. The prompts' key mask is a key-mask input (``Arg(key_mask=True)``):
  it travels with the text tokens (padded with False) and becomes the :class:`ShardContext`'s key mask,
  gathered once per forward, so every block calls ``ctx.attention`` (PipeFusion's stale-K/V attention
  included) without carrying it.
- Every op but attention is per token (RoPE included: each token brings its own (frame, row, column)
  id), so only attention communicates over the sequence axes.
- Tensor parallel (Megatron): q/k/v (both streams) and each MLP's first projection column-parallel,
  ``to_out`` / ``to_add_out`` and each MLP's second projection row-parallel, one all-reduce after each.
  AdaLN modulation and the timestep embedder stay replicated: computed once per step from a [B, E]
  vector. The QK-norm scales are per head_dim, shared by all heads, hence replicated.

Precision: weights and matmuls in the model's ``dtype`` with fp32 accumulation; residual streams, norms,
RoPE, AdaLN modulation and softmax statistics in fp32.
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
from jaxdit.models.layers import Linear, layer_norm, param, rms_norm, rope_angles, sinusoid_frequencies
from jaxdit.models.qwen_image_blocks import EPS, DualStreamBlock, TimestepEmbedder, modulation
from jaxdit.models.qwen_image_config import IMAGE, REFERENCE, TEXT, QwenImageConfig
from jaxdit.models.sharded_forward import Arg, ShardedForward, sharded_staged
from jaxdit.models.staged import staged_forward
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.layout import SequenceLayout

__all__ = [
    "FORWARD_INPUTS",
    "QwenImageTransformer",
    "abstract_model",
    "parameter_shapes",
    "sharded",
    "time_features",
]

#: Width of the sinusoidal timestep embedding (cos half first) and the factor on sigma in [0, 1].
TIME_FREQ_DIM = 256
TIME_SCALE = 1000.0


class QwenImageCond(NamedTuple):
    """What every block reads besides the streams."""

    temb: jax.Array  # [B, E] fp32 timestep embedding
    angles: tuple[jax.Array, jax.Array]  # (text [1, T, D/2], image [1, N, D/2]) fp32, this shard's
    #: Edit-2511 (``zero_cond_t``) with reference tokens: the [B, E] embedding of timestep 0 they take.
    reference_temb: jax.Array | None = None


def time_features(sigma: jax.Array) -> jax.Array:
    """[B] sigma in [0, 1] -> [B, 256] fp32 sinusoids, cos half first (diffusers' ``Timesteps`` with
    ``flip_sin_to_cos``, ``scale=1000``). The scale is applied after the frequencies, as there: the
    angles reach 1000, where the order of two fp32 products changes the sines by ~1e-4."""
    half = TIME_FREQ_DIM // 2
    freqs = jnp.asarray(sinusoid_frequencies(half, 10000.0))
    args = (sigma.astype(jnp.float32)[:, None] * freqs[None]) * TIME_SCALE
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def _stack(make, n: int, rngs: nnx.Rngs):
    """``n`` blocks with a leading layer axis on every parameter, each from its own RNG stream."""
    if n == 0:
        return None

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r: nnx.Rngs):
        return make(r)

    return build(rngs)


class QwenImageTransformer(nnx.Module):
    """Qwen-Image transformer, a staged forward (``jaxdit.models.staged``): embed -> dual-stream blocks
    on the (text, image) streams -> output layer on the image tokens."""

    STACKS = ("transformer_blocks",)
    #: Left in the model's dtype under --quantize fp8: the image stream's MLP, which vLLM-Omni finds loses
    #: quality in FP8 on Qwen-Image (its per-model table, vllm-project/vllm-omni
    #: docs/user_guide/diffusion/quantization/fp8.md: "Skip sensitive layers: img_mlp").
    FP8_KEEP = ("img_mlp",)

    def __init__(self, config: QwenImageConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        cfg = config
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        e = cfg.hidden_size
        self.config = cfg
        self.time_embed = TimestepEmbedder(TIME_FREQ_DIM, e, dtype=dtype, rngs=rngs)
        self.txt_norm = param(rngs, (cfg.joint_attention_dim,), ("in_features",), dtype, init="ones")
        self.img_in = Linear(cfg.in_channels, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.txt_in = Linear(cfg.joint_attention_dim, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.transformer_blocks = _stack(
            lambda r: DualStreamBlock(cfg, dtype=dtype, rngs=r), cfg.num_layers, rngs
        )
        self.norm_out = Linear(e, 2 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype)  # scale, shift
        self.proj_out = Linear(e, cfg.output_features, ("embed", "out_features"), rngs=rngs, dtype=dtype)

    @property
    def dtype(self) -> Any:
        return self.img_in.kernel.dtype

    # ------------------------------------------------------------------ staged forward
    def time_embedding(self, sigma: jax.Array) -> jax.Array:
        """[B] sigma -> [B, E] fp32: the AdaLN vector of every block and the output layer."""
        return self.time_embed(time_features(sigma).astype(self.dtype)).astype(jnp.float32)

    def embed_tokens(self, text: jax.Array, latents: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Text features [B, T, C'] and packed latents [B, N, K] -> the fp32 (text, image) streams."""
        txt = rms_norm(text, self.txt_norm[...], EPS).astype(self.dtype)
        txt = self.txt_in(txt).astype(jnp.float32)
        return txt, self.img_in(latents).astype(jnp.float32)

    def rope(self, ids: jax.Array) -> jax.Array:
        """[n, 3] (frame, row, column) ids -> [n, D/2] fp32 RoPE angles."""
        return rope_angles(ids, self.config.axes_dims_rope, self.config.theta)

    def embed(self, inputs: Mapping[str, jax.Array], ctx: ShardContext) -> tuple[Any, QwenImageCond]:
        """diffusers-named inputs (:data:`FORWARD_INPUTS`, the text mask already in ``ctx``) -> the fp32
        (text, image) streams and the conditioning every block reads."""
        img, ref = inputs["hidden_states"], inputs.get("reference_hidden_states")
        img_ids = inputs["img_ids"]
        if ref is not None:  # the edit pipelines' input pictures: this shard's [image_r; reference_r]
            img = jnp.concatenate([img, ref.astype(img.dtype)], axis=1)
            img_ids = jnp.concatenate([img_ids, inputs["reference_ids"].astype(img_ids.dtype)], axis=0)
        streams = self.embed_tokens(inputs["encoder_hidden_states"], img)
        angles = (self.rope(inputs["txt_ids"])[None], self.rope(img_ids)[None])
        sigma = inputs["timestep"]
        clean = (
            self.time_embedding(jnp.zeros_like(sigma))
            if ref is not None and self.config.zero_cond_t
            else None
        )
        return streams, QwenImageCond(self.time_embedding(sigma), angles, clean)

    def image_tokens(self, stream: jax.Array, ctx: ShardContext) -> jax.Array:
        """This shard's image stream without its reference tokens (none without references)."""
        if len(ctx.layout.lengths) <= REFERENCE:
            return stream
        return stream[:, : ctx.layout.local_lengths[IMAGE]]

    def enter(self, stack: str, streams: Any, ctx: ShardContext) -> Any:
        return streams

    def run_block(self, stack: str, block: nnx.Module, streams: Any, cond: QwenImageCond, ctx: ShardContext):
        if cond.reference_temb is None:
            return block(streams[TEXT], streams[IMAGE], cond.temb, cond.angles, ctx)
        image = ctx.layout.local_lengths[IMAGE]
        return block(streams[TEXT], streams[IMAGE], cond.temb, cond.angles, ctx, cond.reference_temb, image)

    # ------------------------------------------------------------------ feature-cache hooks (jaxdit.cache)
    #: TeaCache's input is computed in the step from the latents (jaxdit.cache.hooks.TeaCacheHooks).
    TEACACHE_METRIC: ClassVar[str] = "step_input"

    def cache_metric_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """First-Block-Cache compares the image stream (as diffusers' hook does): (it, its real tokens)."""
        return streams[IMAGE], ctx.layout.split_after(ctx.token_valid(), TEXT, axis=0)[1]

    def teacache_input(
        self, block: DualStreamBlock, streams: Any, cond: QwenImageCond, ctx: ShardContext
    ) -> tuple[jax.Array, jax.Array]:
        """TeaCache's metric input: the first block's modulated image input, LN(img) * (1 + scale1) +
        shift1 (as TeaCache reads FLUX's; Edit-2511's reference tokens with their timestep-0 modulation,
        as the block has them), and the image's real tokens."""
        img = streams[IMAGE]
        image = ctx.layout.local_lengths[IMAGE]
        shift, scale = block.image_modulations(cond.temb, img.shape[1], cond.reference_temb, image)[:2]
        x = layer_norm(img, EPS) * (1.0 + scale) + shift
        return x, self.cache_metric_stream(streams, ctx)[1]

    def teacache_timestep_input(self, timestep: jax.Array) -> jax.Array:
        raise NotImplementedError("Qwen-Image's TeaCache input depends on the latents (teacache_input)")

    def teacache_defaults(self, grid: tuple[int, ...]) -> None:
        """No TeaCache coefficients are published for Qwen-Image: pass TeaCache(threshold=, coefficients=)."""
        return None

    def cache_output_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """MagCache measures the image stream leaving the last block, and its real tokens."""
        return self.cache_metric_stream(streams, ctx)

    def magcache_defaults(self, grid: tuple[int, ...]) -> dict[str, Any] | None:
        """MagCache's ratios: the authors' calibration of Qwen-Image (MagCache4QwenImage, 50 steps, CFG's
        two branches, threshold 0.06, K 2, retention 0.2) for the published architecture, else jaxdit's
        shipped calibration of this architecture, else None (``--calibrate_magcache``). Qwen-Image-Edit
        has the same architecture and takes these by default; the authors' own Edit set is
        ``MagCache(ratios="qwen-image-edit")``, their ComfyUI 40-step set ``"qwen-image@40steps"``."""
        from jaxdit.cache.magcache import config_key, shipped

        if self.config == QwenImageConfig.preset("qwen-image"):
            return shipped("qwen-image")
        return shipped(config_key("qwen-image", self.config))

    def output(self, streams: Any, cond: QwenImageCond, ctx: ShardContext) -> jax.Array:
        """The image tokens -> the velocity prediction [B, N, patch_size**2 * out_channels]."""
        scale, shift = jnp.split(modulation(self.norm_out, cond.temb), 2, axis=-1)
        x = layer_norm(self.image_tokens(streams[IMAGE], ctx), EPS) * (1.0 + scale[:, None]) + shift[:, None]
        return self.proj_out(x.astype(self.dtype))

    def __call__(
        self,
        hidden_states: jax.Array,
        encoder_hidden_states: jax.Array,
        timestep: jax.Array,
        img_ids: jax.Array,
        txt_ids: jax.Array,
        encoder_hidden_states_mask: jax.Array | None = None,
        *,
        ctx: ShardContext | None = None,
    ) -> jax.Array:
        """Local view: this shard's tokens -> its image tokens' velocity prediction.

        hidden_states [B, N, in_channels] packed latents, encoder_hidden_states [B, T, joint_attention_dim],
        timestep [B] sigma in [0, 1], img_ids [N, 3] and txt_ids [T, 3] (``rope_positions``),
        encoder_hidden_states_mask [B, T] (1 = real token) or None. Without ``ctx`` the call is the whole,
        unsharded model. Returns [B, N, patch_size**2 * out_channels] in the model's dtype.
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
        )
        if encoder_hidden_states_mask is not None:  # as ShardedForward binds a key-mask input
            ctx = ctx.with_key_mask([encoder_hidden_states_mask, None])
        return staged_forward(self, inputs, ctx)


def abstract_model(config: QwenImageConfig, dtype: Any = jnp.float32) -> QwenImageTransformer:
    """The model with ``jax.ShapeDtypeStruct`` parameters: shapes and logical axes, nothing allocated."""
    return nnx.eval_shape(lambda: QwenImageTransformer(config, dtype=dtype, rngs=nnx.Rngs(0)))


def parameter_shapes(config: QwenImageConfig) -> dict[str, tuple[int, ...]]:
    """Dotted parameter path -> shape (stacked blocks with their leading layer axis)."""
    return partitioning.parameter_shapes(abstract_model(config))


# --------------------------------------------------------------------------------------------------------
# On a mesh
# --------------------------------------------------------------------------------------------------------

#: How the forward's inputs lie on the mesh (diffusers' argument names). Text tokens are token group 0 and
#: image tokens group 1, so shard r holds [text_r; image_r]; the ids and the text mask are padded with
#: their tokens (the mask with False); the mask is the context's key mask, not a model input.
FORWARD_INPUTS: dict[str, Arg] = {
    "hidden_states": Arg(("batch", "seq", None), IMAGE),
    "encoder_hidden_states": Arg(("batch", "seq", None), TEXT, model_dtype=True),
    "timestep": Arg(("batch",)),
    "img_ids": Arg(("seq", None), IMAGE),
    "txt_ids": Arg(("seq", None), TEXT),
    "encoder_hidden_states_mask": Arg(("batch", "seq"), TEXT, key_mask=True),
    # The edit pipelines' input pictures: clean packed latents and their ids, never denoised (absent for
    # text-to-image); token group 2, so shard r holds [text_r; image_r; reference_r].
    "reference_hidden_states": Arg(("batch", "seq", None), REFERENCE, model_dtype=True),
    "reference_ids": Arg(("seq", None), REFERENCE),
}
FORWARD_OUTPUT = Arg(("batch", "seq", None), IMAGE)


def sharded(
    model: QwenImageTransformer,
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
