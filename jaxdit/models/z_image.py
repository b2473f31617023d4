"""Z-Image's single-stream DiT (Tongyi-MAI, arXiv 2511.22699) in Flax NNX, the local view of one shard.

Follows diffusers' ``ZImageTransformer2DModel`` (``models/transformers/transformer_z_image.py``): the
patches pass a linear embedder and ``n_refiner_layers`` timestep-modulated *noise refiner* blocks that
attend over the image alone; the caption features (a Qwen3 hidden state) pass an RMSNorm + linear
*caption embedder* and ``n_refiner_layers`` unmodulated *context refiner* blocks over the caption alone;
then ``n_layers`` modulated blocks attend over the joint [image; caption] sequence, and the image tokens
leave through a scale-only AdaLN and a linear layer. The modulation is the timestep's embedding alone.
RoPE has three axes with frequency tables of ``axes_lens`` positions (ids in ``models/z_image_tokens.py``).
Parameters keep diffusers' names where they are one tensor; ``converters/z_image.py`` maps the keys.

Parallel plan (model code never names a mesh axis; it calls the :class:`ShardContext`):

- Image and caption tokens are token groups 0 and 1 of the :class:`SequenceLayout`, sharded over (ring,
  ulysses) and padded where the degrees do not divide them; shard r holds [image_r; caption_r]. The
  refiners attend over one group with that group's own sub-layout (same shards, no data moved), the
  joint layers over both. Each prompt's length is the caption group's key mask (``cap_mask``), gathered
  once per forward; the context refiner slices its part of the gathered mask.
- Every op but attention is per token (each token brings its own RoPE ids), so only attention
  communicates over the sequence axes.
- Tensor parallel (Megatron): q/k/v and the SwiGLU's w1/w3 column-parallel, ``to_out`` and w2
  row-parallel, one all-reduce after each. Heads must split over ulysses x tensor (30 heads: ulysses and
  tensor degrees from 1, 2, 3, 5, 6, 10, 15, 30; 4 and 8 are refused before compiling, with the
  degrees that fit). Modulation and the embedders stay replicated.

Precision: weights and matmuls in the model's ``dtype`` with fp32 accumulation; residual streams, norms,
RoPE, modulation and softmax statistics in fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxdit.mesh import ParallelConfig
from jaxdit.models import partitioning
from jaxdit.models.layers import Linear, layer_norm, param, rms_norm, timestep_embedding
from jaxdit.models.sharded_forward import Arg, ShardedForward, sharded_staged
from jaxdit.models.staged import staged_forward
from jaxdit.models.z_image_blocks import SingleStreamBlock, TimestepEmbedder, linear_fp32
from jaxdit.models.z_image_config import CAPTION, IMAGE, ZImageConfig
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.layout import SequenceLayout

__all__ = [
    "FORWARD_INPUTS",
    "ZImageTransformer",
    "abstract_model",
    "parameter_shapes",
    "rope_tables",
    "sampler_view",
    "sharded",
    "time_features",
]

#: The final LayerNorm's epsilon (diffusers' ``FinalLayer``).
FINAL_EPS = 1e-6


class ZImageCond(NamedTuple):
    """What every block reads besides the streams."""

    temb: jax.Array  # [B, adaln] fp32 timestep embedding
    image_real: jax.Array  # [N_local] bool: this shard's image tokens that are neither pad nor padding
    angles: tuple[jax.Array, jax.Array, jax.Array]  # image, caption, joint [B, *, D/2] fp32 (this shard's)


@functools.lru_cache(maxsize=8)
def rope_tables(
    axes_dims: tuple[int, ...], axes_lens: tuple[int, ...], theta: float
) -> tuple[np.ndarray, ...]:
    """Per axis, the rotation angles of every position [axes_lens[i], axes_dims[i] / 2]: computed in
    float64 and rounded to fp32 once, as diffusers' ``RopeEmbedder`` tabulates them (an fp32 product
    would differ by an ulp of angles up to ~1000 rad, i.e. ~1e-4)."""
    tables = []
    for d, n in zip(axes_dims, axes_lens, strict=True):
        omega = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
        tables.append(np.outer(np.arange(n, dtype=np.float64), omega).astype(np.float32))
    return tuple(tables)


def time_features(timestep: jax.Array, t_scale: float) -> jax.Array:
    """[B] timestep in [0, 1] (1 = clean) -> [B, 256] fp32 sinusoids of timestep x t_scale, cos half first.

    The angles reach 1000 rad, where XLA's and PyTorch's fp32 sin / cos (and PyTorch's exp for the
    frequencies, on a few of them) differ by an ulp: ~1.2e-5 relative at the output against diffusers
    (the rest of the forward agrees to ~3e-6; tests/test_z_image_transformer.py measures both)."""
    return timestep_embedding(timestep.astype(jnp.float32) * t_scale, 256)


def _stack(make, n: int, rngs: nnx.Rngs):
    """``n`` blocks with a leading layer axis on every parameter, each from its own RNG stream."""
    if n == 0:
        return None

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r: nnx.Rngs):
        return make(r)

    return build(rngs)


class ZImageTransformer(nnx.Module):
    """Z-Image transformer, a staged forward (``jaxdit.models.staged``): embed -> noise refiner (image)
    -> context refiner (caption) -> joint layers ([image; caption]) -> output layer on the image."""

    STACKS = ("noise_refiner", "context_refiner", "layers")
    #: Feature caches start at the first joint layer, as diffusers' hooks do (they take the model's
    #: ``layers`` list; the refiners are not in it): the refiners run on every step.
    CACHE_FROM = "layers"

    def __init__(self, config: ZImageConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        cfg = config
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        e = cfg.dim
        self.config = cfg
        self.t_embedder = TimestepEmbedder(cfg, dtype=dtype, rngs=rngs)
        self.x_embedder = Linear(cfg.output_features, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.cap_norm = param(rngs, (cfg.cap_feat_dim,), ("in_features",), dtype, init="ones")
        self.cap_embedder = Linear(cfg.cap_feat_dim, e, ("in_features", "embed"), rngs=rngs, dtype=dtype)
        self.x_pad_token = param(rngs, (1, e), (None, "embed"), dtype)
        self.cap_pad_token = param(rngs, (1, e), (None, "embed"), dtype)

        def block(modulation):
            return lambda r: SingleStreamBlock(cfg, modulation=modulation, dtype=dtype, rngs=r)

        self.noise_refiner = _stack(block(True), cfg.n_refiner_layers, rngs)
        self.context_refiner = _stack(block(False), cfg.n_refiner_layers, rngs)
        self.layers = _stack(block(True), cfg.n_layers, rngs)
        self.final_modulation = Linear(cfg.adaln_dim, e, ("adaln", "embed_out"), rngs=rngs, dtype=dtype)
        self.final_linear = Linear(e, cfg.output_features, ("embed", "out_features"), rngs=rngs, dtype=dtype)
        #: The sampler's view (:func:`sampler_view`): timestep = sigma in, velocity out; else diffusers'.
        self.sampler_view = False

    @property
    def dtype(self) -> Any:
        return self.x_embedder.kernel.dtype

    def angles(self, ids: jax.Array) -> jax.Array:
        """RoPE ids [..., 3] -> angles [..., D/2] fp32, read off the fp32 tables."""
        cfg = self.config
        tables = rope_tables(cfg.axes_dims, cfg.axes_lens, cfg.rope_theta)
        return jnp.concatenate([jnp.asarray(t)[ids[..., i]] for i, t in enumerate(tables)], axis=-1)

    # ------------------------------------------------------------------ staged forward
    def embed(self, inputs: Mapping[str, jax.Array], ctx: ShardContext) -> tuple[Any, ZImageCond]:
        """The inputs of :data:`FORWARD_INPUTS` -> the fp32 (image, caption) streams and the conditioning."""
        cfg = self.config
        timestep = inputs["timestep"]
        if self.sampler_view:  # sigma in, as diffusers' pipeline turns it into the model's time
            sigma = timestep.astype(jnp.float32)
            timestep = (1000.0 - sigma * 1000.0) / 1000.0
        temb = self.t_embedder(time_features(timestep, cfg.t_scale))
        img, cap = self.embed_tokens(
            inputs["hidden_states"], inputs["x_pad"], inputs["cap_feats"], inputs["cap_pad"]
        )
        img_angles, cap_angles = self.angles(inputs["img_ids"]), self.angles(inputs["cap_ids"])
        joint = ctx.layout.join_local([img_angles, cap_angles])
        real = ctx.token_valid()[: ctx.layout.local_lengths[IMAGE]] & ~inputs["x_pad"]
        return (img, cap), ZImageCond(temb, real, (img_angles, cap_angles, joint))

    def embed_tokens(
        self, patches: jax.Array, x_pad: jax.Array | None, cap_feats: jax.Array, cap_pad: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """Latent patches [B, N, p*p*C] and caption features [B, T, C'] -> the fp32 (image, caption)
        streams, the learnt pad tokens where ``x_pad`` [N] (None: no image pad) and ``cap_pad`` [B, T]."""
        img = self.x_embedder(patches.astype(self.dtype)).astype(jnp.float32)
        if x_pad is not None:
            img = jnp.where(x_pad[None, :, None], self.x_pad_token[...].astype(jnp.float32), img)
        cap = rms_norm(cap_feats, self.cap_norm[...], self.config.norm_eps).astype(self.dtype)
        cap = self.cap_embedder(cap).astype(jnp.float32)
        cap = jnp.where(cap_pad[..., None], self.cap_pad_token[...].astype(jnp.float32), cap)
        return img, cap

    def enter(self, stack: str, streams: Any, ctx: ShardContext) -> Any:
        return ctx.layout.join_local(list(streams)) if stack == "layers" else streams

    def run_block(self, stack: str, block: nnx.Module, streams: Any, cond: ZImageCond, ctx: ShardContext):
        if stack == "noise_refiner":
            img = block(streams[IMAGE], cond.temb, cond.angles[IMAGE], ctx.group_attention(IMAGE), ctx)
            return (img, streams[CAPTION])
        if stack == "context_refiner":
            cap = block(streams[CAPTION], None, cond.angles[CAPTION], ctx.group_attention(CAPTION), ctx)
            return (streams[IMAGE], cap)
        return block(streams, cond.temb, cond.angles[2], ctx.attention, ctx)

    def output(self, streams: Any, cond: ZImageCond, ctx: ShardContext) -> jax.Array:
        """The image tokens -> the prediction [B, Npad, p*p*C] (diffusers' sign: the pipeline negates it)."""
        img = ctx.layout.split_after(streams, IMAGE)[0]
        scale = 1.0 + linear_fp32(self.final_modulation, jax.nn.silu(cond.temb))
        x = layer_norm(img, FINAL_EPS) * scale[:, None]
        out = self.final_linear(x.astype(self.dtype))
        if not self.sampler_view:
            return out
        # The velocity is minus the model's prediction; pad tokens predict zero, so that norms over all
        # tokens (CFG renormalisation) are the image's alone and their latents stay as they are.
        return jnp.where(cond.image_real[None, :, None], -out, 0).astype(out.dtype)

    #: TeaCache's input is computed in the step from the latents (jaxdit.cache.hooks.TeaCacheHooks).
    TEACACHE_METRIC: ClassVar[str] = "step_input"

    def teacache_input(
        self, block: SingleStreamBlock, streams: Any, cond: ZImageCond, ctx: ShardContext
    ) -> tuple[jax.Array, jax.Array]:
        """TeaCache's metric input: the first joint block's modulated input RMSNorm(x) * (1 + scale_msa)
        on the whole [image; caption] stream, as TeaCache4Lumina2 (ali-vilab/TeaCache,
        ``TeaCache4Lumina2/teacache_lumina2.py``, ``layers[0].norm1(input_to_main_loop, temb)``) reads the
        same single-stream layout after its refiners; with its real tokens."""
        return block.modulated_input(streams, cond.temb), ctx.token_valid()

    def teacache_timestep_input(self, timestep: jax.Array) -> jax.Array:
        raise NotImplementedError("Z-Image's TeaCache input depends on the latents (teacache_input)")

    def teacache_defaults(self, grid: tuple[int, ...]) -> None:
        """No TeaCache coefficients are published for Z-Image: fit them (``--calibrate_teacache``)."""
        return None

    def cache_output_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """The image tokens leaving the last joint block (what ``output`` predicts from) and which of them
        are not layout padding: MagCache's measure, and the mask of TeaCache calibration's prediction."""
        image = ctx.layout.split_after(streams, IMAGE)[0]
        return image, ctx.layout.split_local(ctx.token_valid(), axis=0)[IMAGE]

    def magcache_defaults(self, grid: tuple[int, ...]) -> None:
        """No MagCache ratios are published for Z-Image: calibrate them (``--calibrate_magcache``)."""
        return None

    def cache_metric_stream(self, streams: Any, ctx: ShardContext) -> tuple[jax.Array, jax.Array]:
        """First-Block-Cache compares what diffusers' hook compares, the first joint layer's residual on
        the whole joint stream [image; caption] (pad tokens included: they are part of the model), over
        the tokens that are not layout padding. Before the joint layers (a cache started earlier), the
        image stream."""
        if isinstance(streams, tuple):
            return streams[IMAGE], ctx.layout.split_local(ctx.token_valid(), axis=0)[IMAGE]
        return streams, ctx.token_valid()

    def __call__(self, *, ctx: ShardContext | None = None, **inputs: jax.Array) -> jax.Array:
        """Local view on the inputs of :data:`FORWARD_INPUTS` (``cap_mask`` may be None); without ``ctx``
        the whole, unsharded model."""
        mask = inputs.pop("cap_mask", None)
        if ctx is None:
            lengths = (inputs["hidden_states"].shape[1], inputs["cap_feats"].shape[1])
            ctx = ShardContext(ParallelConfig(), SequenceLayout(lengths, 1))
        if mask is not None:
            ctx = ctx.with_key_mask([None, jnp.asarray(mask, bool)])
        return staged_forward(self, inputs, ctx)


def sampler_view(model: ZImageTransformer) -> ZImageTransformer:
    """The same parameters as a flow-matching sampler calls the model: ``timestep`` is sigma (1 =
    noise), the model sees diffusers' (1000 - 1000 sigma) / 1000, and the output is the velocity (minus
    the model's prediction, as diffusers' pipeline negates it), zero at pad tokens."""
    view = nnx.merge(*nnx.split(model))
    view.sampler_view = True
    return view


def abstract_model(config: ZImageConfig, dtype: Any = jnp.float32) -> ZImageTransformer:
    """The model with ``jax.ShapeDtypeStruct`` parameters: shapes and logical axes, nothing allocated."""
    return nnx.eval_shape(lambda: ZImageTransformer(config, dtype=dtype, rngs=nnx.Rngs(0)))


def parameter_shapes(config: ZImageConfig) -> dict[str, tuple[int, ...]]:
    """Dotted parameter path -> shape (stacked blocks with their leading layer axis)."""
    return partitioning.parameter_shapes(abstract_model(config))


# --------------------------------------------------------------------------------------------------------
# On a mesh
# --------------------------------------------------------------------------------------------------------

#: How the forward's inputs lie on the mesh (built by ``models/z_image_tokens.py``). Image tokens are
#: token group 0, caption tokens group 1; ``cap_mask`` (each prompt's padded length) becomes the key mask.
FORWARD_INPUTS: dict[str, Arg] = {
    "hidden_states": Arg(("batch", "seq", None), IMAGE, model_dtype=True),
    "x_pad": Arg(("seq",), IMAGE),
    "cap_feats": Arg(("batch", "seq", None), CAPTION, model_dtype=True),
    "cap_pad": Arg(("batch", "seq"), CAPTION),
    "cap_mask": Arg(("batch", "seq"), CAPTION, key_mask=True),
    "timestep": Arg(("batch",)),
    "img_ids": Arg(("batch", "seq", None), IMAGE),
    "cap_ids": Arg(("batch", "seq", None), CAPTION),
}
FORWARD_OUTPUT = Arg(("batch", "seq", None), IMAGE)


def sharded(
    model: ZImageTransformer,
    mesh: Mesh,
    *,
    rules: Mapping[str, object] | None = None,
    kernel: Mapping[str, int] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> ShardedForward:
    """The model's forward as one jitted ``shard_map`` over ``mesh`` on global arrays (see
    :data:`FORWARD_INPUTS`); ``model`` may be abstract for ``lower``. A :func:`sampler_view` of the model
    takes sigma and predicts the velocity."""
    return sharded_staged(
        model,
        mesh,
        FORWARD_INPUTS,
        FORWARD_OUTPUT,
        rules=rules,
        kernel=kernel,
        compiler_options=compiler_options,
    )
