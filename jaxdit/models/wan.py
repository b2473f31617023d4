"""Wan video diffusion transformer (Wan 2.1 T2V 1.3B/14B, I2V 14B; Wan 2.2 A14B experts, TI2V-5B) in Flax
NNX, written as the local view of one sequence shard. The architecture is :class:`WanConfig`
(``models/wan_config.py``), the layers are in ``models/wan_blocks.py`` and the latent <-> token helpers
in ``models/wan_patchify.py``; this module is the transformer and its sharded forward.

Follows ``wan/modules/model.py`` (``WanModel``, Wan-Video/Wan2.1) and diffusers'
``WanTransformer3DModel`` (``models/transformers/transformer_wan.py``), which compute the same thing under
different names; ``converters/wan.py`` maps one onto the other.

Shape letters: B batch, N video tokens (local to a sequence shard inside ``shard_map``), T text tokens,
I image tokens, H heads, D head_dim, E hidden (``dim``), K patch features (in_channels * pt * ph * pw).

Parallel plan (the model never names a mesh axis; it calls the :class:`ShardContext`):

- Video tokens are one token group, sequence-sharded over (ring, ulysses) and padded when the degrees do
  not divide their count. Self-attention goes through ``ctx.attention`` (Ulysses / Ring / USP, padding
  masked). Every other op on video tokens is per token, RoPE included, since each token carries its own
  (frame, row, col) position.
- Cross-attention is local: every sequence shard computes the text (and image) keys and values of all
  512 (+257) context tokens itself. That work, 2 x T x E^2 multiply-adds per block, is duplicated over
  ring x ulysses: for T2V-14B at 720p on ulysses8 the eight devices together do 0.24% more matmul FLOPs
  than one device would (measured from the compiled HLO in tests/test_wan_fullsize.py; the text and
  time embeddings, also computed on every shard, are the last 0.01%). Sharding the context instead
  would cost an all-gather of the K/V per block for a 512-token tensor.
- Tensor parallel: q/k/v and the first FFN projection are column-parallel (output features over
  ``tensor``), o and the second FFN projection row-parallel (one all-reduce each). The RMSNorm of q and k
  runs across ALL heads, so each device sums the squares of its own features and the [.., 1] partial sums
  are all-reduced over ``tensor`` before normalising: two small extra all-reduces per block (self-attention
  q and k in one; cross-attention q, text k and image k in another), B * (2 N + N + T + I) floats each
  block. Time/text/image embeddings and all modulation stay replicated (computed once per step from
  [B, E] vectors or from the short context).

Per-token timesteps (Wan 2.2 TI2V-5B's image conditioning, diffusers' ``expand_timesteps``: the first latent
frame's tokens see t = 0, the others t). diffusers embeds every token's timestep (the time MLP and the 6E
projection per token); here the forward takes the step's timestep [B] and a per-token 0/1
``timestep_mask`` (sequence-sharded like the positions), embeds t and 0 once each ([2, B, ...] instead of
[B, N, ...]) and each block, and the head, select per token between the two modulations. The same
numbers for a sliver of the FLOPs: the two embeddings cost 2B time-MLP rows where diffusers runs B N.
Without a mask the program is Wan 2.1's, unchanged.

Precision: weights and matmuls in ``dtype`` with fp32 accumulation; the residual stream, norms, RoPE,
the time embedding and modulation, and softmax statistics in fp32 (the time embedding and projection
weights and all norm/modulation tables are stored in fp32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxdit.mesh import ParallelConfig
from jaxdit.models import partitioning
from jaxdit.models.layers import Linear, gelu_tanh, layer_norm, param, rope_angles, timestep_embedding
from jaxdit.models.sharded_forward import Arg, ShardedForward, sharded_staged
from jaxdit.models.staged import staged_forward
from jaxdit.models.wan_blocks import (
    WanBlock,
    WanCrossAttention,
    WanImageEmbedding,
    WanSelfAttention,
    fp32_linear,
    token_modulation,
)
from jaxdit.models.wan_config import VAE_FACTORS, WanConfig
from jaxdit.models.wan_patchify import latent_grid, patchify, swap_features, token_positions, unpatchify
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.layout import SequenceLayout

__all__ = [
    "FORWARD_INPUTS",
    "TEXT_LEN",
    "VAE_FACTORS",
    "WanConfig",
    "WanCond",
    "WanCrossAttention",
    "WanSelfAttention",
    "WanTransformer",
    "abstract_model",
    "forward_unsharded",
    "latent_grid",
    "parameter_shapes",
    "patchify",
    "sharded",
    "swap_features",
    "token_positions",
    "unpatchify",
]

#: Wan's text encoder (umT5-XXL) context length; the original model pads prompts to it.
TEXT_LEN = 512


#: TeaCache4Wan2.1's rescaling polynomials (highest power first) and "fast" thresholds, without retention
#: steps (ali-vilab/TeaCache ``TeaCache4Wan2.1/teacache_generate.py`` and its README: about 2x each).
TEACACHE: dict[str, tuple[tuple[float, ...], float]] = {
    "wan2.1-t2v-1.3b": ((2396.76752, -1311.10545, 201.331979, -8.29855975, 0.137887774), 0.08),
    "wan2.1-t2v-14b": ((-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429, -13.02252404), 0.2),
    "wan2.1-i2v-14b@480p": ((-302.331670, 223.948934, -52.5463970, 5.87348440, -0.201973289), 0.26),
    "wan2.1-i2v-14b@720p": ((-114.36346466, 65.26524496, -18.82220707, 4.91518089, -0.23412683), 0.3),
}


class WanCond(NamedTuple):
    """What every Wan block (and the head) reads besides the video stream.

    With per-token timesteps (``token_time`` set) ``temb`` and ``time_mod`` gain a leading axis of 2: the
    embeddings of the step's timestep and of timestep 0 (:func:`token_modulation` picks per token).
    """

    temb: jax.Array  # [B, E] fp32 time embedding (the head's modulation)
    time_mod: jax.Array  # [B, 6, E] fp32 time projection (the blocks' modulation)
    text: jax.Array  # [B, T, E] embedded text context (cross-attention keys/values)
    image: jax.Array | None  # [B, I, E] embedded CLIP features (I2V), else None
    angles: jax.Array  # [1, N, D/2] fp32 RoPE angles of this shard's video tokens
    token_time: jax.Array | None = None  # [1, N, 1] bool: the token sees the timestep (else 0); or None


class WanTransformer(nnx.Module):
    """Wan DiT, a staged forward (``jaxdit.models.staged``): embed -> one stack of blocks -> output.

    Everything is the local view of one sequence shard (see the module docstring); ``__call__`` is the
    whole forward and :func:`forward_unsharded` runs it on one device from a [B, C, F, H, W] latent.
    """

    STACKS = ("blocks",)

    def __init__(self, config: WanConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        cfg = config
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        e = cfg.dim
        self.config = cfg
        self.patch_embedding = Linear(cfg.patch_features, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.text_embedding_1 = Linear(cfg.text_dim, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.text_embedding_2 = Linear(e, e, (None, "embed"), rngs=rngs, dtype=dtype)
        # Time embedding and the projection to the six modulation vectors: fp32 weights (a [B, E] input,
        # computed once per step; the numbers that scale every block's activations).
        self.time_embedding_1 = Linear(cfg.freq_dim, e, (None, "embed"), rngs=rngs, dtype=jnp.float32)
        self.time_embedding_2 = Linear(e, e, (None, "embed"), rngs=rngs, dtype=jnp.float32)
        self.time_projection = Linear(e, 6 * e, (None, None), rngs=rngs, dtype=jnp.float32)
        self.image_embedding = WanImageEmbedding(cfg, dtype, rngs) if cfg.is_i2v else None
        self.blocks = nnx.vmap(lambda r: WanBlock(cfg, dtype, r))(rngs.split(cfg.num_layers))
        self.head_modulation = param(rngs, (2, e), (None, "embed"), jnp.float32, scale=e**-0.5)
        self.head = Linear(e, cfg.out_features, ("embed", None), rngs=rngs, dtype=dtype)

    @property
    def dtype(self) -> Any:
        return self.patch_embedding.kernel.dtype

    def embed_time(self, timestep: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(temb [B, E], time projection [B, 6, E]) in fp32 from timesteps [B] in [0, 1000)."""
        cfg = self.config
        t = timestep_embedding(jnp.asarray(timestep).reshape(-1), cfg.freq_dim)
        temb = fp32_linear(self.time_embedding_2, jax.nn.silu(fp32_linear(self.time_embedding_1, t)))
        return temb, fp32_linear(self.time_projection, jax.nn.silu(temb)).reshape(-1, 6, cfg.dim)

    def embed_context(
        self, text: jax.Array, image: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        """(text [B, T, E], image [B, I, E] or None): the cross-attention context, step-independent."""
        txt = gelu_tanh(self.text_embedding_1(text).astype(jnp.float32)).astype(self.dtype)
        txt = self.text_embedding_2(txt)
        img = None
        if self.image_embedding is not None:
            if image is None:
                raise ValueError("an I2V Wan model needs encoder_hidden_states_image (CLIP features)")
            img = self.image_embedding(image)
        elif image is not None:
            raise ValueError("encoder_hidden_states_image given to a T2V Wan model (it has no image input)")
        return txt, img

    def embed_conditions(
        self, timestep: jax.Array, text: jax.Array, image: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """(temb [B, E], time projection [B, 6, E], text [B, T, E], image [B, I, E] or None).

        Replicated over sequence shards: they depend on the timestep and the short context only.
        """
        return (*self.embed_time(timestep), *self.embed_context(text, image))

    # ------------------------------------------------------------------ staged forward
    def embed_token_time(
        self, timestep: jax.Array, mask: jax.Array | None
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """(temb, time projection, token_time) of :class:`WanCond`: without a mask :meth:`embed_time`;
        with ``mask`` [N] (1: the token sees ``timestep``, 0: timestep 0) the embeddings of the timestep
        and of 0, stacked ([2, B, E], [2, B, 6, E]), and the mask as [1, N, 1] bool."""
        if mask is None:
            return (*self.embed_time(timestep), None)
        t = jnp.asarray(timestep, jnp.float32).reshape(-1)
        temb, time_mod = self.embed_time(jnp.concatenate([t, jnp.zeros_like(t)]))
        pair = lambda a: a.reshape(2, t.shape[0], *a.shape[1:])
        return pair(temb), pair(time_mod), (jnp.asarray(mask) > 0)[None, :, None]

    def embed(self, inputs: Mapping[str, jax.Array], ctx: ShardContext) -> tuple[jax.Array, WanCond]:
        """diffusers-named inputs (:data:`FORWARD_INPUTS`: patch tokens, their positions, timestep (and
        per-token timestep mask), text and image context) -> the fp32 video stream and the conditioning
        every block reads."""
        cfg = self.config
        temb, time_mod, token_time = self.embed_token_time(inputs["timestep"], inputs.get("timestep_mask"))
        txt, img = self.embed_context(
            inputs["encoder_hidden_states"], inputs.get("encoder_hidden_states_image")
        )
        angles = rope_angles(inputs["positions"], cfg.rope_axes_dim, cfg.rope_theta)[None]
        x = self.patch_embedding(inputs["hidden_states"]).astype(jnp.float32)
        return x, WanCond(temb, time_mod, txt, img, angles, token_time)

    def enter(self, stack: str, streams: jax.Array, ctx: ShardContext) -> jax.Array:
        return streams

    def run_block(
        self, stack: str, block: nnx.Module, streams: jax.Array, cond: WanCond, ctx: ShardContext
    ) -> jax.Array:
        return block(
            streams, cond.time_mod, cond.text, cond.image, cond.angles, ctx, token_time=cond.token_time
        )

    def head_prediction(
        self, x: jax.Array, temb: jax.Array, token_time: jax.Array | None = None
    ) -> jax.Array:
        """The video stream [B, N, E] -> output patches [B, N, pt*ph*pw*C_out] fp32 (features (p, c)).
        ``temb`` [B, E], or [2, B, E] with ``token_time`` (see :func:`token_modulation`)."""
        cfg = self.config
        if token_time is None:
            table, vectors = self.head_modulation[...][None], temb[:, None, :]
            shift, scale = (table + vectors).transpose(1, 0, 2)[:, :, None]
        else:
            shift, scale = token_modulation(temb[:, :, None, :], self.head_modulation[...], token_time)
        h = (layer_norm(x, cfg.eps) * (1 + scale) + shift).astype(self.dtype)
        return self.head(h).astype(jnp.float32)

    def output(self, streams: jax.Array, cond: WanCond, ctx: ShardContext) -> jax.Array:
        return self.head_prediction(streams, cond.temb, cond.token_time)

    # ------------------------------------------------------------------ feature-cache hooks (jaxdit.cache)
    #: TeaCache's input is the time embedding: the host plans it (jaxdit.cache.hooks.CacheHooks).
    TEACACHE_METRIC: ClassVar[str] = "schedule"

    def cache_metric_stream(self, streams: jax.Array, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """First-Block-Cache / DBCache compare the video stream: (it, its real tokens)."""
        return streams, ctx.token_valid()

    def cache_output_stream(self, streams: jax.Array, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """MagCache measures the video tokens (MagCache4Wan2.1's residual of all blocks)."""
        return streams, ctx.token_valid()

    def teacache_input(self, block: Any, streams: Any, cond: Any, ctx: ShardContext) -> Any:
        raise NotImplementedError("Wan's TeaCache input is the time embedding (teacache_timestep_input)")

    def magcache_defaults(self, grid: tuple[int, ...]) -> dict[str, Any] | None:
        """MagCache's ratios: the authors' calibration of this published model (MagCache4Wan2.1 /
        MagCache4Wan2.2: two branches, conditional and unconditional; I2V 14B 480P / 720P by ``grid`` as
        for TeaCache; TI2V-5B's text-to-video set), else jaxdit's shipped calibration of this
        architecture, else None."""
        from jaxdit.cache.magcache import config_key, shipped

        cfg = self.config
        short_side = min(grid[1:], default=0) * cfg.patch_size[1] * 8
        for preset in WanConfig.PRESETS:
            if dataclasses.replace(cfg, **WanConfig.PRESETS[preset]) != cfg:
                continue
            if preset == "wan2.1-i2v-14b":
                preset += "@720p" if short_side >= 720 else "@480p"
            found = shipped(preset)
            if found is not None:
                return found
        return shipped(config_key("wan", cfg))

    def teacache_timestep_input(self, timestep: jax.Array) -> jax.Array:
        """TeaCache's metric input, the time embedding [B, E] (TeaCache4Wan2.1's ``e``): it depends on the
        timestep only, so the skip pattern is computed before the loop."""
        return self.embed_time(timestep)[0]

    def teacache_defaults(self, grid: tuple[int, ...]) -> tuple[tuple[float, ...], float] | None:
        """The published polynomial and the "fast" threshold (about 2x) of this model, or None for a
        size TeaCache4Wan2.1 did not fit. I2V: the 720P model's when the frames are 720 pixels or more on
        the short side (``grid`` is the (frames, rows, cols) token grid; 8 pixels per latent), else the
        480P model's."""
        cfg = self.config
        short_side = min(grid[1:], default=0) * cfg.patch_size[1] * 8
        for name, fitted in TEACACHE.items():
            preset, _, resolution = name.partition("@")
            if dataclasses.replace(cfg, **WanConfig.PRESETS[preset]) != cfg:
                continue
            if resolution and (short_side >= 720) != (resolution == "720p"):
                continue
            return fitted
        return None

    def __call__(
        self,
        patches: jax.Array,
        positions: jax.Array,
        timestep: jax.Array,
        text: jax.Array,
        image: jax.Array | None = None,
        *,
        timestep_mask: jax.Array | None = None,
        ctx: ShardContext | None = None,
    ) -> jax.Array:
        """Local view: this shard's tokens -> its output patches.

        patches [B, N, K] (this shard's video tokens, :func:`patchify` order, padded per ``ctx.layout``),
        positions [N, 3] int (frame, row, col) of those tokens, timestep [B] in [0, 1000), text
        [B, T, text_dim], image [B, I, image_dim] (I2V only), timestep_mask [N] 0/1 (per-token
        timesteps: 0 makes the token see timestep 0). Without ``ctx`` the call is the whole, unsharded
        model. Returns [B, N, pt*ph*pw*C_out] fp32.
        """
        if ctx is None:
            ctx = ShardContext(ParallelConfig(), SequenceLayout((patches.shape[1],), 1))
        inputs = dict(
            hidden_states=patches,
            positions=positions,
            timestep=timestep,
            encoder_hidden_states=text,
            encoder_hidden_states_image=image,
            timestep_mask=timestep_mask,
        )
        return staged_forward(self, inputs, ctx)


def forward_unsharded(
    model: WanTransformer,
    hidden_states: jax.Array,
    timestep: jax.Array,
    encoder_hidden_states: jax.Array,
    encoder_hidden_states_image: jax.Array | None = None,
    timestep_mask: jax.Array | None = None,
) -> jax.Array:
    """diffusers' ``WanTransformer3DModel.forward`` on one device: [B, C, F, H, W] -> [B, C_out, F, H, W]
    (``timestep_mask``: [N] per-token 0/1, see :meth:`WanTransformer.__call__`)."""
    cfg = model.config
    grid = latent_grid(hidden_states.shape, cfg.patch_size)
    patches = patchify(hidden_states, cfg.patch_size)
    positions = jnp.asarray(token_positions(grid))
    out = model(
        patches,
        positions,
        timestep,
        encoder_hidden_states,
        encoder_hidden_states_image,
        timestep_mask=timestep_mask,
    )
    return unpatchify(out, grid, cfg.patch_size, cfg.out_channels)


def abstract_model(config: WanConfig, dtype: Any = jnp.float32) -> WanTransformer:
    """The model with ``jax.ShapeDtypeStruct`` parameters: shapes and logical axes, nothing allocated."""
    return nnx.eval_shape(lambda: WanTransformer(config, dtype=dtype, rngs=nnx.Rngs(0)))


def parameter_shapes(config: WanConfig) -> dict[str, tuple[int, ...]]:
    """Dotted parameter path -> shape (stacked blocks with their leading layer axis)."""
    return partitioning.parameter_shapes(abstract_model(config))


# --------------------------------------------------------------------------------------------------------
# On a mesh
# --------------------------------------------------------------------------------------------------------

#: How the sharded forward's inputs lie on the mesh. The video tokens (patchified latents), their
#: positions and the per-token timestep mask (TI2V; optional) are token group 0, sequence-sharded; the
#: timestep, text and image context are split over the batch only, so every sequence shard holds the
#: whole context (cross-attention is local). The mask is shared by every sample (diffusers broadcasts one
#: first-frame mask over the batch), so it has no batch axis and never travels with the CFG branches.
FORWARD_INPUTS: dict[str, Arg] = {
    "hidden_states": Arg(("batch", "seq", None), 0),
    "positions": Arg(("seq", None), 0),
    "timestep": Arg(("batch",)),
    "encoder_hidden_states": Arg(("batch", None, None), model_dtype=True),
    "encoder_hidden_states_image": Arg(("batch", None, None), model_dtype=True),
    "timestep_mask": Arg(("seq",), 0),
}
FORWARD_OUTPUT = Arg(("batch", "seq", None), 0)


def sharded(
    model: WanTransformer,
    mesh: Mesh,
    *,
    rules: Mapping[str, object] | None = None,
    kernel: Mapping[str, int] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> ShardedForward:
    """The model's forward on patch tokens as one jitted ``shard_map`` over ``mesh`` (see
    :data:`FORWARD_INPUTS`: ``hidden_states`` [B, N, K] from :func:`patchify`, ``positions`` [N, 3]
    from :func:`token_positions`). ``model`` may be abstract (:func:`abstract_model`) for
    :meth:`ShardedForward.lower`. ``jaxdit.load_transformer`` wraps it with patchify/unpatchify."""
    return sharded_staged(
        model,
        mesh,
        FORWARD_INPUTS,
        FORWARD_OUTPUT,
        rules=rules,
        kernel=kernel,
        compiler_options=compiler_options,
    )
