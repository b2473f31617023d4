"""FLUX.2 with PipeFusion (arXiv 2405.14430): how FLUX.2's tokens and stacks meet the runner.

Stages. As FLUX.1's (``pipefusion/flux.py``): the double-stream blocks, then the single-stream blocks,
each stacked array split over the P stages (ceil(L/P) slots per device), two passes V-shaped (up through
the double blocks, back down through the single ones), so a patch's step ends on stage 0 and its latent
never moves. A FLUX.2 block holds no modulation weights: the three modulation vectors are computed once
per step from the step's embedding and read by every block of their stack, so every stage computes them
itself with the time embedding (replicated, a [B, 15E] vector). A padded slot holds zeros: its attention
output and MLP-down projections are zero, so the block adds nothing to the stream (an exact identity).

Tokens. FLUX.1's geometry (:class:`~jaxdit.pipelines.pipefusion.flux.Geometry`): the joint sequence is
[text; image; reference], patch m carries text chunk m, a band of image rows and (editing) reference
chunk m, each padded for the R x U sequence shards. Reference tokens are context like the text: the
patch carries them through both passes, their K/V are buffered like the rest, and only the image rows
are predicted and stepped (the model's output reads the IMAGE group alone).

Embeddings and the final layer are replicated; the patch is embedded on stage 0 and the final layer and
sampler step run there too.
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

from converters.flux2 import CHECKPOINTS
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux2
from jaxdit.models.flux2_config import Flux2Config
from jaxdit.pipelines.pipefusion.cache import PIPEFUSION_CACHES
from jaxdit.pipelines.pipefusion.flux import Geometry, default_num_patches, validate_patches
from jaxdit.pipelines.pipefusion.stages import StagedModel

__all__ = ["Flux2Patches", "PipeFusionFlux2"]

#: Position ids per token: (time, row, column, text position).
ID_AXES = 4


def _check_model(config: Flux2Config, parallel: ParallelConfig) -> None:
    parallel.validate_heads(config.num_heads)
    if config.num_layers < 1 or config.num_single_layers < 1:
        raise ValueError(
            "PipeFusion for FLUX.2 runs the double blocks up the stages and the single blocks back down; "
            f"this model has {config.num_layers} double and {config.num_single_layers} single blocks"
        )


class PipeFusionFlux2(StagedModel):
    """A FLUX.2 transformer's parameters laid out for PipeFusion: ``double_blocks`` and
    ``single_blocks`` in stage slots (see ``stages.py``: :meth:`load`, :meth:`from_model`,
    :meth:`abstract`)."""

    checkpoints = CHECKPOINTS
    wrong_family = "{path}: PipeFusion runs FLUX.2 checkpoints here; this one is {family}"
    dtype_param = ("img_in", "kernel")
    depth_fields = {"double_blocks": "num_layers", "single_blocks": "num_single_layers"}
    check = staticmethod(_check_model)
    abstract_model = staticmethod(flux2.abstract_model)


class _Pieces:
    """FLUX.2's own embedders and conditioning on one generation's patches (inside the program)."""

    def __init__(self, model: flux2.Flux2Transformer, context: dict, g: Geometry, full: bool, batch):
        self.model, self.batch = model, batch
        self.guidance = context.get("guidance")
        text, ref = context["encoder_hidden_states"], context.get("reference_hidden_states")
        self.rows = text.shape[0]
        ids = [context[n] for n in ("txt_ids", "img_ids", "reference_ids") if context.get(n) is not None]
        flat = lambda x: None if x is None else x.reshape(x.shape[0], -1, x.shape[-1])
        if full:  # every patch: [text of every patch; image of every patch(; reference)] on this device
            self.text, self.ref = flat(text), flat(ref)
            joined = g.full_layout().join_local([i.reshape(-1, ID_AXES) for i in ids], axis=0)
            self.angles = model.angles(joined)[None]
        else:
            self.text, self.ref = text, ref  # [B, M, t, C']: patch m's text (and reference) chunk
            join = lambda *groups: g.patch_layout().join_local(list(groups), axis=0)
            self.angles = model.angles(jax.vmap(join)(*ids))  # [M, t+n(+r), D/2]

    def step_cond(self, sigma: jax.Array) -> flux2.StepCond:
        t = jnp.full((self.rows,), sigma, jnp.float32)
        return self.model.step_conditioning(t, self.guidance)

    def embed(self, x: jax.Array, patch: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        chunk = lambda c: c if c is None or patch is None else lax.dynamic_index_in_dim(c, patch, 1, False)
        return self.model.embed_tokens(
            self.batch(x).astype(self.model.dtype), chunk(self.text), chunk(self.ref)
        )

    def cond(self, step: flux2.StepCond, patch: jax.Array | None) -> flux2.Flux2Cond:
        return flux2.Flux2Cond(*step, self.angles if patch is None else self.angles[patch][None])

    def prediction(self, pred: jax.Array) -> jax.Array:
        return pred


@dataclasses.dataclass(frozen=True)
class Flux2Patches:
    """What the PipeFusion runner asks of FLUX.2 (``family.PatchFamily``), for a model ``config``.

    The programs' context is the forward context by diffusers' names, laid out in patches: patch m's
    padded text chunk (``encoder_hidden_states`` [B, M, S*t, C'], ``txt_ids`` [M, S*t, 4]), image positions
    (``img_ids`` [M, S*n, 4]), reference chunk (``reference_hidden_states`` [B, M, S*r, C],
    ``reference_ids`` [M, S*r, 4]) when editing, and ``guidance`` [B] (dev) as it is.
    """

    config: Flux2Config

    #: The feature caches this runner takes (host-planned: ``pipefusion/cache.py``).
    caches = PIPEFUSION_CACHES

    context_axes = {
        "encoder_hidden_states": ("batch", None, "seq", None),
        "guidance": ("batch",),
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
        guidance = context.get("guidance")
        ref, r = "reference_hidden_states" in context or None, g.reference
        return {
            "encoder_hidden_states": (g.pad_text(f32("encoder_hidden_states"), 1), dtype),
            "guidance": None if guidance is None else (f32("guidance"), jnp.float32),
            "txt_ids": (g.pad_text(f32("txt_ids"), 0), jnp.float32),
            "img_ids": (g.to_patches(f32("img_ids"), 0), jnp.float32),
            "reference_hidden_states": ref and (g.pad_text(f32("reference_hidden_states"), 1, r), dtype),
            "reference_ids": ref and (g.pad_text(f32("reference_ids"), 0, r), jnp.float32),
        }

    def abstract_context(self, g: Geometry, dtype: Any) -> dict[str, tuple | None]:
        c, m, s, r = self.config, g.patches, g.seq, g.reference_piece
        return {
            "encoder_hidden_states": ((g.batch, m, s * g.text_piece, c.joint_attention_dim), dtype),
            "guidance": ((g.batch,), jnp.float32) if c.guidance_embeds else None,
            "txt_ids": ((m, s * g.text_piece, ID_AXES), jnp.float32),
            "img_ids": ((m, s * g.image_piece, ID_AXES), jnp.float32),
            "reference_hidden_states": g.reference and ((g.batch, m, s * r, c.in_channels), dtype) or None,
            "reference_ids": g.reference and ((m, s * r, ID_AXES), jnp.float32) or None,
        }

    def pieces(
        self, model: nnx.Module, context: dict, g: Geometry, *, full: bool, batch: Callable
    ) -> _Pieces:
        return _Pieces(model, context, g, full, batch)
