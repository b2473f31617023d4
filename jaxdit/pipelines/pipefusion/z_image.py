"""Z-Image with PipeFusion (arXiv 2405.14430): how Z-Image's tokens and its three stacks meet the runner.

Stages. The noise refiner, the context refiner and the joint layers are three stacks, each split over
the P stages (ceil(L/P) slots per device; a padded slot holds zeros, whose output RMSNorm scales make the
block an exact identity, modulated or not). Three stacks are three passes (V = 3, odd): up, down, up; a
patch's step ends on stage P-1, which runs the output layer, CFG and the sampler step and sends the
updated latent patch back to stage 0 (``programs.py``).

Tokens. The joint sequence is [image; caption] (token groups 0 and 1). Patch m carries a band of image
rows and caption chunk m (FLUX's text layout, :class:`~jaxdit.pipelines.pipefusion.flux.Geometry`, in
Z-Image's group order), each padded for the R x U sequence shards. The caption keeps its learnt pad
tokens up to each prompt's multiple of 32 (part of the model, as in the plain forward); a prompt's
length below the batch's longest is its key mask, handed to the programs as ``sample_valid``. The image
is not padded: PipeFusion needs rows x cols a multiple of 32 (1024 x 1024: 64 x 64), else it is refused.

The refiners attend over one group alone: ``ctx.group_attention`` inside a stage
(:meth:`~jaxdit.parallel.pipefusion.PatchContext.group_attention`) masks the other group's keys in the
fresh block and in the stale buffer, which is exact.

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

from converters.z_image import CHECKPOINTS
from jaxdit.mesh import ParallelConfig
from jaxdit.models import z_image
from jaxdit.models.z_image_config import ZImageConfig
from jaxdit.models.z_image_tokens import SEQ_MULTIPLE
from jaxdit.pipelines.pipefusion import flux, qwen_image
from jaxdit.pipelines.pipefusion.cache import PIPEFUSION_CACHES
from jaxdit.pipelines.pipefusion.stages import StagedModel

__all__ = ["PASSES", "Geometry", "PipeFusionZImage", "ZImagePatches", "default_num_patches", "validate_grid"]

#: Passes over the stages per forward: noise refiner (up), context refiner (down), joint layers (up).
PASSES = len(z_image.ZImageTransformer.STACKS)


def validate_grid(rows: int, cols: int) -> None:
    """PipeFusion splits the image rows; an image the model pads (tokens not a multiple of 32) is refused."""
    if (rows * cols) % SEQ_MULTIPLE:
        raise ValueError(
            f"Z-Image pads {rows} x {cols} = {rows * cols} image tokens to a multiple of {SEQ_MULTIPLE}, and "
            "PipeFusion's patches are whole rows without pad tokens: use a size whose token count is a "
            f"multiple of {SEQ_MULTIPLE} (e.g. 1024 x 1024), or sequence parallelism"
        )


def default_num_patches(stages: int, rows: int, cols: int, sequence_degree: int = 1) -> int:
    """A full pipeline: the fewest patches M >= 3P (a patch is back at stage 0 after 3P ticks) that are
    whole rows of ``rows`` whose tokens ring x ulysses split; where none does, Qwen-Image's choice (P, or
    the smallest count above P that divides the rows). 1024 x 1024 (64 rows): 8, 16 and 32 patches on 2,
    4 and 8 stages. ``jaxdit plan`` prices this count (``ZImageFamily.pipefusion_patches``)."""
    full = range(PASSES * stages, rows + 1)
    fits = (m for m in full if rows % m == 0 and (rows // m * cols) % sequence_degree == 0)
    return next(fits, None) or qwen_image.default_num_patches(stages, rows)


def _check_model(config: ZImageConfig, parallel: ParallelConfig) -> None:
    parallel.validate_heads(config.n_heads)
    if config.n_layers < 1 or config.n_refiner_layers < 1:
        raise ValueError(
            "PipeFusion for Z-Image splits its refiners and its joint layers over the stages; this model has "
            f"{config.n_refiner_layers} refiner and {config.n_layers} joint layers"
        )


class PipeFusionZImage(StagedModel):
    """A Z-Image transformer's parameters laid out for PipeFusion: ``noise_refiner``,
    ``context_refiner`` and ``layers`` in stage slots (see ``stages.py``)."""

    checkpoints = CHECKPOINTS
    wrong_family = "{path}: PipeFusion runs Z-Image checkpoints here; this one is {family}"
    dtype_param = ("x_embedder", "kernel")
    depth_fields = {
        "noise_refiner": "n_refiner_layers",
        "context_refiner": "n_refiner_layers",
        "layers": "n_layers",
    }
    check = staticmethod(_check_model)
    abstract_model = staticmethod(z_image.abstract_model)


@dataclasses.dataclass(frozen=True)
class Geometry(flux.Geometry):
    """FLUX's patch geometry (``text`` = the padded caption length) with Z-Image's group order: a
    patch holds [image rows; caption chunk]."""

    @property
    def pieces(self) -> tuple[int, ...]:
        return (self.image_piece, self.text_piece)

    def piece_valid(self) -> tuple[np.ndarray | None, ...]:
        text = self.text_valid()
        return (None, None if text.all() else text)


class _Pieces:
    """Z-Image's embedders and conditioning on one generation's patches (inside the program)."""

    def __init__(self, model: z_image.ZImageTransformer, context: dict, g: Geometry, full: bool, batch):
        self.model, self.batch, self.g, self.full = model, batch, g, full
        names = ("cap_feats", "cap_pad", "cap_ids", "img_ids")
        arrays = [context[n] for n in names]
        if full:  # every patch at once: [image of every patch; caption of every patch] on this device
            arrays = [a.reshape(a.shape[0], -1, *a.shape[3:]) for a in arrays]
        self.cap, self.pad, cap_ids, img_ids = arrays
        self.img_angles, self.cap_angles = model.angles(img_ids), model.angles(cap_ids)
        mask = context.get("cap_mask")  # [b, M, S*t] replicated over the sequence axes
        self.sample_valid = (
            None if mask is None else (None, mask.reshape(mask.shape[0], g.patches, g.seq, -1))
        )

    def _pick(self, a: jax.Array, patch: jax.Array | None) -> jax.Array:
        return a if patch is None else lax.dynamic_index_in_dim(a, patch, 1, False)

    def step_cond(self, sigma: jax.Array) -> jax.Array:
        # The model's time as diffusers' pipeline gives it: (1000 - 1000 sigma) / 1000.
        t = jnp.full((self.cap.shape[0],), (1000.0 - sigma * 1000.0) / 1000.0, jnp.float32)
        return self.model.t_embedder(z_image.time_features(t, self.model.config.t_scale))

    def embed(self, x: jax.Array, patch: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        return self.model.embed_tokens(
            self.batch(x), None, self._pick(self.cap, patch), self._pick(self.pad, patch)
        )

    def cond(self, temb: jax.Array, patch: jax.Array | None) -> z_image.ZImageCond:
        img, cap = self._pick(self.img_angles, patch), self._pick(self.cap_angles, patch)
        layout = self.g.full_layout() if self.full else self.g.patch_layout()
        joint = layout.join_local([img, cap])
        return z_image.ZImageCond(temb, jnp.ones((img.shape[1],), bool), (img, cap, joint))

    def prediction(self, pred: jax.Array) -> jax.Array:
        return -pred  # the velocity: minus the model's prediction, as diffusers' pipeline negates it


@dataclasses.dataclass(frozen=True)
class ZImagePatches:
    """What the PipeFusion runner asks of Z-Image (``family.PatchFamily``), for a model ``config``.

    Program context: ``cap_feats`` [B, M, S*t, C'], ``cap_pad`` [B, M, S*t] and ``cap_ids`` [B, M, S*t,
    3] in patch chunks (FLUX's text layout), ``img_ids`` [B, M, S*n, 3], and ``cap_mask`` [B, M, S*t]
    (each prompt's tokens, chunked like the caption, replicated over the sequence axes), or None.
    """

    config: ZImageConfig

    #: The feature caches this runner takes (host-planned: ``pipefusion/cache.py``).
    caches = PIPEFUSION_CACHES

    context_axes = {
        "cap_feats": ("batch", None, "seq", None),
        "cap_pad": ("batch", None, "seq"),
        "cap_ids": ("batch", None, "seq", None),
        "img_ids": ("batch", None, "seq", None),
        "cap_mask": ("batch", None, None),
    }

    @property
    def width(self) -> int:
        return self.config.dim

    @property
    def latent_features(self) -> int:
        return self.config.output_features

    def default_patches(self, grid: tuple[int, int], parallel: ParallelConfig) -> int:
        return default_num_patches(parallel.pipefusion, *grid, parallel.sequence_degree)

    def validate_patches(self, grid: tuple[int, int], patches: int, parallel: ParallelConfig) -> None:
        validate_grid(*grid)
        flux.validate_patches(*grid, patches, parallel.sequence_degree)

    def geometry(
        self, grid: tuple[int, int], patches: int, parallel: ParallelConfig, requests: int, context: Mapping
    ) -> Geometry:
        batch, text = np.shape(context["cap_feats"])[:2]
        return Geometry(text, *grid, patches, parallel.ring, parallel.ulysses, batch, requests)

    def program_context(self, context: Mapping, g: Geometry, dtype: Any) -> dict[str, tuple | None]:
        mask = context.get("cap_mask")
        rows = len(context["cap_feats"])
        return {
            "cap_feats": (g.pad_text(np.asarray(context["cap_feats"], np.float32), 1), dtype),
            "cap_pad": (g.pad_text(np.asarray(context["cap_pad"], bool), 1), jnp.bool_),
            "cap_ids": (g.pad_text(np.asarray(context["cap_ids"], np.int32), 1), jnp.int32),
            "img_ids": (g.to_patches(np.asarray(context["img_ids"], np.int32), 1), jnp.int32),
            "cap_mask": None
            if mask is None
            else (g.pad_text(np.asarray(mask, bool), 1).reshape(rows, g.patches, -1), jnp.bool_),
        }

    def abstract_context(self, g: Geometry, dtype: Any) -> dict[str, tuple | None]:
        m, s, t, n = g.patches, g.seq, g.text_piece, g.image_piece
        return {
            "cap_feats": ((g.batch, m, s * t, self.config.cap_feat_dim), dtype),
            "cap_pad": ((g.batch, m, s * t), jnp.bool_),
            "cap_ids": ((g.batch, m, s * t, 3), jnp.int32),
            "img_ids": ((g.batch, m, s * n, 3), jnp.int32),
            "cap_mask": ((g.batch, m, s * t), jnp.bool_),
        }

    def pieces(
        self, model: nnx.Module, context: dict, g: Geometry, *, full: bool, batch: Callable
    ) -> _Pieces:
        return _Pieces(model, context, g, full, batch)
