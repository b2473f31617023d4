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
        self.rows = text.shape[0]
        rope = lambda ids: model.rope(ids.reshape(-1, 3)).reshape(*ids.shape[:-1], -1)
        if full:  # every patch at once: [text of every patch; image of every patch]
            self.text = text.reshape(text.shape[0], -1, text.shape[-1])
            self.angles = (rope(context["txt_ids"]).reshape(1, -1, rope_dim(model)),) + (
                rope(context["img_ids"]).reshape(1, -1, rope_dim(model)),
            )
        else:
            self.text = text  # [b, M, t, C']: patch m's text chunk
            self.angles = (rope(context["txt_ids"]), rope(context["img_ids"]))  # [M, t | n, D/2]
        # [b, M, S*t] replicated over the sequence axes -> [b, M, S, t] real text tokens per piece.
        self.sample_valid = None
        if mask is not None:
            self.sample_valid = (mask.reshape(mask.shape[0], g.patches, g.seq, -1), None)

    def step_cond(self, sigma: jax.Array) -> jax.Array:
        return self.model.time_embedding(jnp.full((self.rows,), sigma, jnp.float32))

    def embed(self, x: jax.Array, patch: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        text = self.text if patch is None else lax.dynamic_index_in_dim(self.text, patch, 1, False)
        return self.model.embed_tokens(text, self.batch(x).astype(self.model.dtype))

    def cond(self, temb: jax.Array, patch: jax.Array | None) -> qwen_image.QwenImageCond:
        angles = self.angles if patch is None else tuple(a[patch][None] for a in self.angles)
        return qwen_image.QwenImageCond(temb, angles)

    def prediction(self, pred: jax.Array) -> jax.Array:
        return pred


def rope_dim(model: qwen_image.QwenImageTransformer) -> int:
    return model.config.head_dim // 2


@dataclasses.dataclass(frozen=True)
class QwenImagePatches:
    """What the PipeFusion runner asks of Qwen-Image (``family.PatchFamily``), for a model ``config``.

    Program context: ``encoder_hidden_states`` [B, M, S*t, C'] and ``txt_ids`` [M, S*t, 3] in patch
    chunks (FLUX's text layout), ``img_ids`` [M, S*n, 3], and ``encoder_hidden_states_mask`` [B, M, S*t]
    (the prompts' real tokens, chunked like the text, replicated over the sequence axes).
    """

    config: QwenImageConfig

    context_axes = {
        "encoder_hidden_states": ("batch", None, "seq", None),
        "encoder_hidden_states_mask": ("batch", None, None),
        "txt_ids": (None, "seq", None),
        "img_ids": (None, "seq", None),
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
        return Geometry(text, *grid, patches, parallel.ring, parallel.ulysses, batch, requests)

    def program_context(self, context: Mapping, g: Geometry, dtype: Any) -> dict[str, tuple | None]:
        f32 = lambda name: np.asarray(context[name], np.float32)
        mask = context.get("encoder_hidden_states_mask")
        return {
            "encoder_hidden_states": (g.pad_text(f32("encoder_hidden_states"), 1), dtype),
            "encoder_hidden_states_mask": None
            if mask is None
            else (g.pad_text(np.asarray(mask, bool), 1).reshape(len(mask), g.patches, -1), jnp.bool_),
            "txt_ids": (g.pad_text(f32("txt_ids"), 0), jnp.float32),
            "img_ids": (g.to_patches(f32("img_ids"), 0), jnp.float32),
        }

    def abstract_context(self, g: Geometry, dtype: Any) -> dict[str, tuple | None]:
        c, m, s = self.config, g.patches, g.seq
        return {
            "encoder_hidden_states": ((g.batch, m, s * g.text_piece, c.joint_attention_dim), dtype),
            "encoder_hidden_states_mask": ((g.batch, m, s * g.text_piece), jnp.bool_),
            "txt_ids": ((m, s * g.text_piece, 3), jnp.float32),
            "img_ids": ((m, s * g.image_piece, 3), jnp.float32),
        }

    def pieces(
        self, model: nnx.Module, context: dict, g: Geometry, *, full: bool, batch: Callable
    ) -> _Pieces:
        return _Pieces(model, context, g, full, batch)
