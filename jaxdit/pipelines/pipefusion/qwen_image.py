"""Qwen-Image with PipeFusion (arXiv 2405.14430): how Qwen-Image's tokens and its one stack meet the runner.

Stages. The 60 dual-stream blocks are one stacked array split over the P stages (ceil(60/P) slots per
device, padded slots holding zeros: their AdaLN gates are zero, an exact identity). One stack is one pass
(V = 1, odd): a patch goes up the stages and its step ends on stage P-1, which runs the output layer, CFG
and the sampler step and sends the updated latent patch back to stage 0 (``programs.py``).

Tokens. As FLUX.1's (``pipefusion/flux.py``, whose :class:`~jaxdit.pipelines.pipefusion.flux.Geometry`
this reuses): the joint sequence is [text; image], patch m carries text chunk m and a band of image rows,
each padded for the R x U sequence shards. What Qwen-Image adds is the prompts' key mask: prompts keep
their own lengths (positive and negative differ), so the text's real tokens differ per batch row. The
mask enters the programs like the text, in patch chunks, but replicated over the sequence axes (every
device needs every shard's keys), and the pieces hand it to the programs as ``sample_valid``: fresh and
stale keys are then masked per row.

The edit pipelines' input pictures (``QwenImageEditPipeline``): their clean latent tokens are a third
token group, context like the text (as FLUX.1 Kontext's, the geometry's ``reference`` group): split into M
chunks, patch m carrying chunk m after its image rows, embedded by the image stream's weights and run
through the blocks in the image stream ([image band; reference chunk] per piece), computed once per step
in its patch's micro-step, their K/V buffered like every other token's; they leave no prediction (the
output layer reads the image band only) and the sampler never steps them. Edit-2511 (``zero_cond_t``)
gives them the modulation of timestep 0.

Host-planned caches (MagCache, TaylorSeer: ``cache.py``) take the runner's skipped step as it is: the
residual of all blocks is kept on the whole [text; image(; reference)] piece, of which the output layer
reads the image band alone; Edit-2511's timestep-0 modulation of the reference tokens enters the blocks
only, so a skipped step (no block) needs nothing of it.

Embeddings and the output layer are replicated; every stage computes the timestep embedding itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from converters.qwen_image import CHECKPOINTS
from jaxdit.mesh import ParallelConfig
from jaxdit.models import qwen_image
from jaxdit.models.qwen_image_config import QwenImageConfig
from jaxdit.pipelines.pipefusion.cache import PIPEFUSION_CACHES
from jaxdit.pipelines.pipefusion.flux import Geometry, validate_patches
from jaxdit.pipelines.pipefusion.stages import StagedModel

__all__ = ["PipeFusionQwenImage", "QwenImagePatches", "default_num_patches"]


def default_num_patches(stages: int, rows: int) -> int:
    """P patches (one pass: a patch is back at stage 0 after P ticks, so P keep the pipeline full), or
    the smallest count above P that divides the ``rows`` of packed tokens, else P."""
    return next((m for m in range(stages, rows + 1) if rows % m == 0), stages)


def _check_model(config: QwenImageConfig, parallel: ParallelConfig) -> None:
    parallel.validate_heads(config.num_heads)
    if config.num_layers < 1:
        raise ValueError("PipeFusion splits the dual-stream blocks over the stages; this model has none")


class PipeFusionQwenImage(StagedModel):
    """A Qwen-Image transformer's parameters laid out for PipeFusion: ``transformer_blocks`` in stage
    slots (see ``stages.py``: :meth:`load`, :meth:`from_model`, :meth:`abstract`)."""

    checkpoints = CHECKPOINTS
    wrong_family = "{path}: PipeFusion runs Qwen-Image checkpoints here; this one is {family}"
    dtype_param = ("img_in", "kernel")
    depth_fields = {"transformer_blocks": "num_layers"}
    check = staticmethod(_check_model)
    abstract_model = staticmethod(qwen_image.abstract_model)


class _Pieces:
    """Qwen-Image's embedders and conditioning on one generation's patches (inside the program)."""

    def __init__(self, model: qwen_image.QwenImageTransformer, context: dict, g: Geometry, full: bool, batch):
        self.model, self.batch, self.full = model, batch, full
        text, mask = context["encoder_hidden_states"], context["encoder_hidden_states_mask"]
        ref, ref_ids = context.get("reference_hidden_states"), context.get("reference_ids")
        self.rows = text.shape[0]
        rope = lambda ids: model.rope(ids.reshape(-1, 3)).reshape(*ids.shape[:-1], -1)
        angles = [rope(context["txt_ids"]), rope(context["img_ids"])]  # [M, t | n, D/2]
        ref_angles = None if ref_ids is None else rope(ref_ids)  # [M, r, D/2]
        if full:  # every patch at once: [text of every patch; image of every patch(; reference)]
            flat = lambda x: None if x is None else x.reshape(x.shape[0], -1, x.shape[-1])
            self.text, self.ref = flat(text), flat(ref)
            one = lambda a: None if a is None else a.reshape(1, -1, a.shape[-1])  # [1, M*(t | n | r), D/2]
            angles, ref_angles = [one(a) for a in angles], one(ref_angles)
        else:
            self.text, self.ref = text, ref  # [b, M, t | r, C']: patch m's text (and reference) chunk
        if ref_angles is not None:  # the image stream is [image; reference], in the layout's order
            angles[1] = jnp.concatenate([angles[1], ref_angles], axis=1)
        self.angles = tuple(angles)
        # Edit-2511: the reference tokens' modulation from timestep 0 (the same for every step).
        self.clean = ref is not None and model.config.zero_cond_t
        # [b, M, S*t] replicated over the sequence axes -> [b, M, S, t] real text tokens per piece; the
        # image and reference groups' real tokens are the geometry's.
        self.sample_valid = None
        if mask is not None:
            rest = (None, None) if ref is not None else (None,)
            self.sample_valid = (mask.reshape(mask.shape[0], g.patches, g.seq, -1), *rest)

    def step_cond(self, sigma: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        embed = lambda s: self.model.time_embedding(jnp.full((self.rows,), s, jnp.float32))
        return embed(sigma), embed(0.0) if self.clean else None

    def embed(self, x: jax.Array, patch: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        chunk = lambda c: c if c is None or patch is None else lax.dynamic_index_in_dim(c, patch, 1, False)
        latents = self.batch(x).astype(self.model.dtype)
        if self.ref is not None:  # this piece's image band, then its reference chunk
            latents = jnp.concatenate([latents, chunk(self.ref).astype(latents.dtype)], axis=1)
        return self.model.embed_tokens(chunk(self.text), latents)

    def cond(
        self, temb: tuple[jax.Array, jax.Array | None], patch: jax.Array | None
    ) -> qwen_image.QwenImageCond:
        angles = self.angles if patch is None else tuple(a[patch][None] for a in self.angles)
        return qwen_image.QwenImageCond(temb[0], angles, temb[1])

    def prediction(self, pred: jax.Array) -> jax.Array:
        return pred


@dataclasses.dataclass(frozen=True)
class QwenImagePatches:
    """What the PipeFusion runner asks of Qwen-Image (``family.PatchFamily``), for a model ``config``.

    Program context: ``encoder_hidden_states`` [B, M, S*t, C'] and ``txt_ids`` [M, S*t, 3] in patch
    chunks (FLUX's text layout), ``img_ids`` [M, S*n, 3], and ``encoder_hidden_states_mask`` [B, M, S*t]
    (the prompts' real tokens, chunked like the text, replicated over the sequence axes); the edit
    pipelines' ``reference_hidden_states`` [B, M, S*r, K] and ``reference_ids`` [M, S*r, 3], chunked like
    the text.
    """

    config: QwenImageConfig

    #: The feature caches this runner takes (host-planned: ``pipefusion/cache.py``).
    caches = PIPEFUSION_CACHES

    context_axes = {
        "encoder_hidden_states": ("batch", None, "seq", None),
        "encoder_hidden_states_mask": ("batch", None, None),
        "txt_ids": (None, "seq", None),
        "img_ids": (None, "seq", None),
        "reference_hidden_states": ("batch", None, "seq", None),
        "reference_ids": (None, "seq", None),
    }

    @property
    def width(self) -> int:
        return self.config.hidden_size

    @property
    def latent_features(self) -> int:
        return self.config.in_channels

    def default_patches(self, grid: tuple[int, int], parallel: ParallelConfig) -> int:
        return default_num_patches(parallel.pipefusion, grid[0])

    def validate_patches(self, grid: tuple[int, int], patches: int, parallel: ParallelConfig) -> None:
        validate_patches(*grid, patches, parallel.sequence_degree)

    def geometry(
        self, grid: tuple[int, int], patches: int, parallel: ParallelConfig, requests: int, context: Mapping
    ) -> Geometry:
        batch, text = np.shape(context["encoder_hidden_states"])[:2]
        ref = np.shape(context["reference_hidden_states"])[1] if "reference_hidden_states" in context else 0
        return Geometry(text, *grid, patches, parallel.ring, parallel.ulysses, batch, requests, ref)

    def program_context(self, context: Mapping, g: Geometry, dtype: Any) -> dict[str, tuple | None]:
        f32 = lambda name: np.asarray(context[name], np.float32)
        mask = context.get("encoder_hidden_states_mask")
        ref, r = "reference_hidden_states" in context or None, g.reference
        return {
            "encoder_hidden_states": (g.pad_text(f32("encoder_hidden_states"), 1), dtype),
            "encoder_hidden_states_mask": None
            if mask is None
            else (g.pad_text(np.asarray(mask, bool), 1).reshape(len(mask), g.patches, -1), jnp.bool_),
            "txt_ids": (g.pad_text(f32("txt_ids"), 0), jnp.float32),
            "img_ids": (g.to_patches(f32("img_ids"), 0), jnp.float32),
            "reference_hidden_states": ref and (g.pad_text(f32("reference_hidden_states"), 1, r), dtype),
            "reference_ids": ref and (g.pad_text(f32("reference_ids"), 0, r), jnp.float32),
        }

    def abstract_context(self, g: Geometry, dtype: Any) -> dict[str, tuple | None]:
        c, m, s, r = self.config, g.patches, g.seq, g.reference_piece
        return {
            "encoder_hidden_states": ((g.batch, m, s * g.text_piece, c.joint_attention_dim), dtype),
            "encoder_hidden_states_mask": ((g.batch, m, s * g.text_piece), jnp.bool_),
            "txt_ids": ((m, s * g.text_piece, 3), jnp.float32),
            "img_ids": ((m, s * g.image_piece, 3), jnp.float32),
            "reference_hidden_states": g.reference and ((g.batch, m, s * r, c.in_channels), dtype) or None,
            "reference_ids": g.reference and ((m, s * r, 3), jnp.float32) or None,
        }

    def pieces(
        self, model: nnx.Module, context: dict, g: Geometry, *, full: bool, batch: Callable
    ) -> _Pieces:
        return _Pieces(model, context, g, full, batch)
