"""HunyuanVideo 1.5's video DiT (Tencent Hunyuan) in Flax NNX, the local view of one
shard.

Follows diffusers' ``HunyuanVideo15Transformer3DModel`` (``models/transformers/
transformer_hunyuan_video15.py``): the latent patches pass a linear patch embedding; the Qwen2.5-VL prompt
features pass a linear layer and ``num_refiner_layers`` token-refiner blocks that attend over the prompt
alone, conditioned on the timestep and the prompt's masked mean; the ByT5 glyph features and the image
encoder's tokens pass their own small MLPs; each kind of condition token gets its learnt type embedding.
``num_layers`` dual-stream blocks then attend jointly over [video; condition tokens] with the condition
tokens' key mask, RoPE on the video tokens only (three axes, base 256), and the video tokens leave through
an AdaLN (scale first) and a linear layer. The AdaLN vector is the timestep's embedding (plus a second
timestep's for the MeanFlow variants, when one is passed); the timestep enters unscaled (diffusers'
pipeline passes t in [0, 1000]). Parameters keep diffusers' names where they are one tensor; ``converters/
hunyuan_video15.py`` maps the keys.

diffusers moves every sample's real condition tokens in front of its padding (image, glyph, prompt) and
zeroes the padding before the blocks. Attention does not depend on the order of its keys, every other op
is per token, and padded keys are masked, so here each kind of condition token is its own token group in
its own order and only the masks say which are real: the video prediction is the same.

Shape letters: B batch, N video tokens, T prompt tokens, G glyph tokens, I image tokens (local to one
sequence shard inside ``shard_map``), H heads, D head_dim, E hidden.

Parallel plan (model code never names a mesh axis; it calls the :class:`ShardContext`):

- Video, prompt, glyph and image tokens are token groups 0-3 of the :class:`SequenceLayout` (no image
  group in text-to-video: its image tokens are all masked in diffusers, so they are left out), each
  sequence-sharded over (ring, ulysses) and padded where the degrees do not divide it; shard r holds
  [video_r; prompt_r; glyph_r; image_r]. The three condition masks are key-mask inputs, gathered once per
  forward. The token refiner attends over the prompt group with its own sub-layout (same shards, no data
  moved); the dual-stream blocks over all groups.
- The refiner's pooled prompt (a masked mean over all prompt tokens) is an input computed outside the
  step (:func:`forward_inputs`), so no reduction over the sequence shards is added to the step.
- Tensor parallel (Megatron): q/k/v and each MLP's first projection column-parallel, ``to_out`` /
  ``to_add_out`` and each MLP's second projection row-parallel, one all-reduce after each (refiner
  blocks alike). Embedders, modulation and the output layer stay replicated.

Precision: weights and matmuls in the model's ``dtype`` with fp32 accumulation; residual streams, norms,
RoPE, AdaLN modulation and softmax statistics in fp32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from flax import nnx
from jax.sharding import Mesh

from jaxdit.mesh import ParallelConfig
from jaxdit.models import partitioning
from jaxdit.models.hunyuan_video15_blocks import (
    DualStreamBlock,
    GlyphProjection,
    ImageProjection,
    RefinerBlock,
    TimestepEmbedder,
    modulation,
)
from jaxdit.models.hunyuan_video15_cache_hooks import HunyuanVideo15CacheHooks
from jaxdit.models.hunyuan_video15_config import GLYPH, IMAGE, TEXT, VIDEO, HunyuanVideo15Config
from jaxdit.models.layers import Linear, layer_norm, param, rope_angles, timestep_embedding
from jaxdit.models.sharded_forward import Arg, ShardedForward, sharded_staged
from jaxdit.models.staged import staged_forward
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.layout import SequenceLayout

__all__ = [
    "FORWARD_INPUTS",
    "HunyuanVideo15Transformer",
    "abstract_model",
    "condition_inputs",
    "forward_inputs",
    "parameter_shapes",
    "patchify",
    "sharded",
    "token_positions",
    "unpatchify",
]

#: Width of the sinusoidal timestep embedding (cos half first, no frequency shift).
TIME_FREQ_DIM = 256
#: Rows of the condition-type embedding: prompt, glyph, image tokens.
COND_TYPES = 3


class HunyuanVideo15Cond(NamedTuple):
    """What every block reads besides the streams."""

    temb: jax.Array  # [B, E] fp32: the dual-stream blocks' and the output layer's AdaLN vector
    refiner_temb: jax.Array  # [B, E] fp32: the token refiner's (timestep + pooled prompt)
    angles: jax.Array  # [1, N, D/2] fp32 RoPE angles of this shard's video tokens


def _stack(make, n: int, rngs: nnx.Rngs):
    """``n`` blocks with a leading layer axis on every parameter, each from its own RNG stream."""
    if n == 0:
        return None

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r: nnx.Rngs):
        return make(r)

    return build(rngs)


class ContextEmbedder(nnx.Module):
    """The prompt tokens' embedder before the refiner blocks (diffusers' ``HunyuanVideo15TokenRefiner``
    without its blocks, which the model stacks): the refiner's conditioning and the input projection."""

    def __init__(self, cfg: HunyuanVideo15Config, *, dtype: Any, rngs: nnx.Rngs):
        e = cfg.hidden_size
        self.timestep_embedder = TimestepEmbedder(TIME_FREQ_DIM, e, dtype=dtype, rngs=rngs)
        self.text_embedder = TimestepEmbedder(cfg.text_embed_dim, e, dtype=dtype, rngs=rngs)
        self.proj_in = Linear(cfg.text_embed_dim, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)


class HunyuanVideo15Transformer(HunyuanVideo15CacheHooks, nnx.Module):
    """HunyuanVideo 1.5 transformer, a staged forward (``jaxdit.models.staged``): embed -> token-refiner
    blocks (prompt tokens) -> dual-stream blocks (video, condition tokens) -> output layer on the video."""

    STACKS = ("refiner_blocks", "transformer_blocks")
    #: Feature caches start at the first dual-stream block: the token refiner touches the prompt tokens
    #: only, so the video stream's residual across it is zero (the refiner blocks run on every step).
    CACHE_FROM = "transformer_blocks"

    def __init__(
        self, config: HunyuanVideo15Config, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None
    ):
        cfg = config
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        e = cfg.hidden_size
        self.config = cfg
        self.x_embedder = Linear(cfg.input_features, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.image_embedder = ImageProjection(cfg, dtype=dtype, rngs=rngs)
        self.context_embedder = ContextEmbedder(cfg, dtype=dtype, rngs=rngs)
        self.context_embedder_2 = GlyphProjection(cfg, dtype=dtype, rngs=rngs)
        self.time_embed = TimestepEmbedder(TIME_FREQ_DIM, e, dtype=dtype, rngs=rngs)
        self.time_embed_r = (
            TimestepEmbedder(TIME_FREQ_DIM, e, dtype=dtype, rngs=rngs) if cfg.use_meanflow else None
        )
        self.cond_type_embed = param(rngs, (COND_TYPES, e), ("cond_types", "embed"), dtype)
        self.refiner_blocks = _stack(
            lambda r: RefinerBlock(cfg, dtype=dtype, rngs=r), cfg.num_refiner_layers, rngs
        )
        self.transformer_blocks = _stack(
            lambda r: DualStreamBlock(cfg, dtype=dtype, rngs=r), cfg.num_layers, rngs
        )
        self.norm_out = Linear(e, 2 * e, ("embed", "modulation"), rngs=rngs, dtype=dtype)  # scale, shift
        self.proj_out = Linear(e, cfg.output_features, ("embed", "out_features"), rngs=rngs, dtype=dtype)

    @property
    def dtype(self) -> Any:
        return self.x_embedder.kernel.dtype

    # ------------------------------------------------------------------ staged forward
    def _time(self, embedder: TimestepEmbedder, t: jax.Array) -> jax.Array:
        return embedder(timestep_embedding(t, TIME_FREQ_DIM).astype(self.dtype))

    def step_conditioning(
        self, t: jax.Array, pooled: jax.Array, t_r: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """(the blocks' and output layer's AdaLN vector, the token refiner's) of timesteps ``t`` [B] (and
        ``t_r`` for MeanFlow models) and the pooled prompt [B, C]: fp32 [B, E] each. A MeanFlow model
        called without ``t_r`` leaves its second term out, as diffusers' time embedding does (its
        text-to-video pipeline passes none; the image-to-video one passes the next timestep)."""
        temb = self._time(self.time_embed, t)
        if self.time_embed_r is not None and t_r is not None:
            temb = temb + self._time(self.time_embed_r, t_r)
        ce = self.context_embedder
        return temb, self._time(ce.timestep_embedder, t) + ce.text_embedder(pooled)

    def embed_tokens(
        self, hidden_states: jax.Array, prompt: jax.Array, glyph: jax.Array, image: jax.Array | None
    ) -> tuple[Any, ...]:
        """The fp32 (video, prompt, glyph, image) streams of the model-input tokens (image None:
        text-to-video): each token embedded alone, so any subset of tokens (a PipeFusion patch) embeds
        the same."""
        types = self.cond_type_embed[...].astype(jnp.float32)
        return (
            self.x_embedder(hidden_states).astype(jnp.float32),
            self.context_embedder.proj_in(prompt).astype(jnp.float32),
            self.context_embedder_2(glyph) + types[GLYPH - TEXT],
            None if image is None else self.image_embedder(image) + types[IMAGE - TEXT],
        )

    def embed(self, inputs: Mapping[str, jax.Array], ctx: ShardContext) -> tuple[Any, HunyuanVideo15Cond]:
        """The inputs of :data:`FORWARD_INPUTS` (the masks already in ``ctx``) -> the fp32 (video, prompt,
        glyph, image) streams and the conditioning every block reads."""
        cfg = self.config
        temb, refiner_temb = self.step_conditioning(
            inputs["timestep"], inputs["pooled_projections"], inputs.get("timestep_r")
        )
        streams = self.embed_tokens(
            inputs["hidden_states"],
            inputs["encoder_hidden_states"],
            inputs["encoder_hidden_states_2"],
            inputs.get("image_embeds"),  # None: text-to-video, no image tokens at all
        )
        angles = rope_angles(inputs["video_ids"], cfg.rope_axes_dim, cfg.rope_theta)[None]
        return streams, HunyuanVideo15Cond(temb, refiner_temb, angles)

    def enter(self, stack: str, streams: Any, ctx: ShardContext) -> Any:
        if stack != "transformer_blocks":
            return streams
        video, prompt, glyph, image = streams  # the refined prompt gets its type embedding now
        prompt = prompt + self.cond_type_embed[...].astype(jnp.float32)[0]
        return video, ctx.layout.join_local([prompt, glyph] + ([] if image is None else [image]))

    def run_block(self, stack: str, block: nnx.Module, streams: Any, cond: HunyuanVideo15Cond, ctx):
        if stack == "refiner_blocks":
            video, prompt, glyph, image = streams
            prompt = block(prompt, cond.refiner_temb, ctx.group_attention(TEXT), ctx)
            return video, prompt, glyph, image
        return block(streams[0], streams[1], cond.temb, cond.angles, ctx)

    def output(self, streams: Any, cond: HunyuanVideo15Cond, ctx: ShardContext) -> jax.Array:
        """The video tokens -> the prediction [B, N, out_channels * pt * ph * pw] (features (c, t, h, w))."""
        scale, shift = jnp.split(modulation(self.norm_out, cond.temb), 2, axis=-1)
        x = layer_norm(streams[0], 1e-6) * (1.0 + scale[:, None]) + shift[:, None]
        return self.proj_out(x.astype(self.dtype))

    def __call__(self, *, ctx: ShardContext | None = None, **inputs: jax.Array) -> jax.Array:
        """Local view on the inputs of :data:`FORWARD_INPUTS`; without ``ctx`` the whole, unsharded
        model (the three masks become its key masks)."""
        masks = [inputs.pop(name, None) for name in _MASKS]
        if inputs.get("image_embeds") is None:
            inputs.pop("image_embeds", None)
            masks = masks[:2]
        if ctx is None:
            lengths = tuple(inputs[name].shape[1] for name in _TOKENS if name in inputs)
            ctx = ShardContext(ParallelConfig(), SequenceLayout(lengths, 1))
        masks = [None] + [None if m is None else jnp.asarray(m, bool) for m in masks]
        ctx = ctx.with_key_mask(masks)
        return staged_forward(self, inputs, ctx)


def abstract_model(config: HunyuanVideo15Config, dtype: Any = jnp.float32) -> HunyuanVideo15Transformer:
    """The model with ``jax.ShapeDtypeStruct`` parameters: shapes and logical axes, nothing allocated."""
    return nnx.eval_shape(lambda: HunyuanVideo15Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))


def parameter_shapes(config: HunyuanVideo15Config) -> dict[str, tuple[int, ...]]:
    """Dotted parameter path -> shape (stacked blocks with their leading layer axis)."""
    return partitioning.parameter_shapes(abstract_model(config))


# --------------------------------------------------------------------------------------------------------
# Tokens (global view, outside shard_map)
# --------------------------------------------------------------------------------------------------------

_TOKENS = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_2", "image_embeds")
_MASKS = ("encoder_attention_mask", "encoder_attention_mask_2", "image_embeds_mask")


def latent_grid(shape: Sequence[int], config: HunyuanVideo15Config) -> tuple[int, int, int]:
    """(F', H', W') token grid of a [B, C, F, H, W] latent; its sizes must be multiples of the patch."""
    (f, h, w), (pt, ph, pw) = (int(s) for s in shape[-3:]), config.patch
    if f % pt or h % ph or w % pw:
        raise ValueError(
            f"latent frames x height x width {f}x{h}x{w} are not multiples of the patch {pt}x{ph}x{pw}"
        )
    return f // pt, h // ph, w // pw


def patchify(latents: Any, config: HunyuanVideo15Config, channels: int | None = None) -> Any:
    """[B, C, F, H, W] -> [B, F'*H'*W', C*pt*ph*pw] tokens in (frame, row, column) order, each a patch in
    the Conv3d weight's (c, t, h, w) order (the patch embedding is a Conv3d with kernel = stride).
    ``channels``: C (default the model's ``in_channels``; the sampler's latents have ``out_channels``)."""
    channels = config.in_channels if channels is None else channels
    if latents.ndim != 5 or latents.shape[1] != channels:
        raise ValueError(f"latents have shape {tuple(latents.shape)}; expected [B, {channels}, F, H, W]")
    latent_grid(latents.shape, config)
    pt, ph, pw = config.patch
    return rearrange(latents, "b c (f pt) (h ph) (w pw) -> b (f h w) (c pt ph pw)", pt=pt, ph=ph, pw=pw)


def unpatchify(tokens: Any, grid: Sequence[int], config: HunyuanVideo15Config) -> Any:
    """[B, N, C*pt*ph*pw] predictions -> [B, C, F, H, W], as diffusers reshapes its output."""
    (f, h, w), (pt, ph, pw) = grid, config.patch
    pattern = "b (f h w) (c pt ph pw) -> b c (f pt) (h ph) (w pw)"
    return rearrange(tokens, pattern, f=f, h=h, w=w, pt=pt, ph=ph, pw=pw)


def token_positions(grid: Sequence[int]) -> np.ndarray:
    """[N, 3] float32 (frame, row, column) of every video token in patchify order: diffusers'
    ``HunyuanVideo15RotaryPosEmbed`` grid (static, numpy)."""
    f, h, w = grid
    pos = np.stack(np.meshgrid(np.arange(f), np.arange(h), np.arange(w), indexing="ij"), axis=-1)
    return pos.reshape(-1, 3).astype(np.float32)


def pooled_prompt(features: Any, mask: Any) -> np.ndarray:
    """The refiner's pooled prompt: the mean of each prompt's real tokens' features, in fp32 [B, C]."""
    x = np.asarray(features, np.float32)
    m = np.asarray(mask, np.float32)[..., None]
    return (x * m).sum(axis=1) / m.sum(axis=1)


def condition_inputs(
    encoder_hidden_states: Any,
    encoder_attention_mask: Any,
    encoder_hidden_states_2: Any,
    encoder_attention_mask_2: Any,
    image_embeds: Any,
    config: HunyuanVideo15Config,
) -> dict[str, np.ndarray]:
    """The condition tokens of diffusers' forward arguments (prompt / glyph features and masks, the image
    encoder's tokens) -> those arrays of :data:`FORWARD_INPUTS` (numpy; masks bool, the pooled prompt).

    As diffusers, the image tokens are real when any image embedding of the call is non-zero, and all
    masked otherwise (text-to-video). Masked tokens change no prediction, so text-to-video has no image
    tokens at all here (``image_embeds`` and its mask None: the forward then has three token groups).
    ``image_embeds`` None: the same as zeros.
    """
    c, sizes = config, {}

    def check(name, x, dims):
        x = np.asarray(x)
        if x.ndim != len(dims):
            raise ValueError(f"{name} has shape {x.shape}; expected {len(dims)} dims {dims}")
        for n, (d, want) in enumerate(zip(x.shape, dims, strict=True)):
            if isinstance(want, int) and d != want:
                raise ValueError(f"{name} has shape {x.shape}; dimension {n} should be {want}")
            if isinstance(want, str) and sizes.setdefault(want, d) != d:
                raise ValueError(f"{name} has shape {x.shape}; its {want} is {sizes[want]} elsewhere")
        return x

    text = check("encoder_hidden_states", encoder_hidden_states, ("B", "T", c.text_embed_dim))
    mask = check("encoder_attention_mask", encoder_attention_mask, ("B", "T")).astype(bool)
    glyph = check("encoder_hidden_states_2", encoder_hidden_states_2, ("B", "G", c.text_embed_2_dim))
    glyph_mask = check("encoder_attention_mask_2", encoder_attention_mask_2, ("B", "G")).astype(bool)
    if image_embeds is None or not np.any(np.asarray(image_embeds)):
        image = image_mask = None
    else:
        image = check("image_embeds", image_embeds, ("B", "I", c.image_embed_dim))
        image_mask = np.ones(image.shape[:2], bool)
    if not mask.any(axis=1).all():
        raise ValueError("encoder_attention_mask: every prompt needs at least one real token")
    return dict(
        encoder_hidden_states=text,
        encoder_attention_mask=mask,
        pooled_projections=pooled_prompt(text, mask),
        encoder_hidden_states_2=glyph,
        encoder_attention_mask_2=glyph_mask,
        image_embeds=image,
        image_embeds_mask=image_mask,
    )


def forward_inputs(
    hidden_states: Any,
    encoder_hidden_states: Any,
    encoder_attention_mask: Any,
    encoder_hidden_states_2: Any,
    encoder_attention_mask_2: Any,
    image_embeds: Any,
    config: HunyuanVideo15Config,
) -> dict[str, np.ndarray]:
    """diffusers' forward arguments (a [B, in_channels, F, H, W] latent and :func:`condition_inputs`') ->
    the arrays of :data:`FORWARD_INPUTS` but the timesteps (numpy)."""
    latents = np.asarray(hidden_states)
    inputs = condition_inputs(
        encoder_hidden_states,
        encoder_attention_mask,
        encoder_hidden_states_2,
        encoder_attention_mask_2,
        image_embeds,
        config,
    )
    if latents.shape[:1] != inputs["encoder_hidden_states"].shape[:1]:
        raise ValueError(
            f"hidden_states has batch {latents.shape[0]}; the prompts {inputs['encoder_hidden_states'].shape[0]}"
        )
    tokens = np.asarray(patchify(latents, config))
    return dict(inputs, hidden_states=tokens, video_ids=token_positions(latent_grid(latents.shape, config)))


# --------------------------------------------------------------------------------------------------------
# On a mesh
# --------------------------------------------------------------------------------------------------------

#: How the forward's inputs lie on the mesh (built by :func:`forward_inputs`): video tokens are token group
#: 0, prompt 1, glyph 2, image 3; each condition group's mask becomes its key mask, not a model input.
FORWARD_INPUTS: dict[str, Arg] = {
    "hidden_states": Arg(("batch", "seq", None), VIDEO, model_dtype=True),
    "video_ids": Arg(("seq", None), VIDEO),
    "timestep": Arg(("batch",)),
    "timestep_r": Arg(("batch",)),
    "encoder_hidden_states": Arg(("batch", "seq", None), TEXT, model_dtype=True),
    "encoder_attention_mask": Arg(("batch", "seq"), TEXT, key_mask=True),
    "pooled_projections": Arg(("batch", None), model_dtype=True),
    "encoder_hidden_states_2": Arg(("batch", "seq", None), GLYPH, model_dtype=True),
    "encoder_attention_mask_2": Arg(("batch", "seq"), GLYPH, key_mask=True),
    "image_embeds": Arg(("batch", "seq", None), IMAGE, model_dtype=True),
    "image_embeds_mask": Arg(("batch", "seq"), IMAGE, key_mask=True),
}
FORWARD_OUTPUT = Arg(("batch", "seq", None), VIDEO)


def sharded(
    model: HunyuanVideo15Transformer,
    mesh: Mesh,
    *,
    rules: Mapping[str, object] | None = None,
    kernel: Mapping[str, int] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> ShardedForward:
    """The model's forward as one jitted ``shard_map`` over ``mesh`` on global arrays (see
    :data:`FORWARD_INPUTS`); ``model`` may be abstract for ``lower``."""
    return sharded_staged(
        model,
        mesh,
        FORWARD_INPUTS,
        FORWARD_OUTPUT,
        rules=rules,
        kernel=kernel,
        compiler_options=compiler_options,
    )
