"""HunyuanVideo 1.5 with PipeFusion (arXiv 2405.14430): how its tokens and its two stacks meet the runner.

Stages. The token refiner (2 blocks in the released models) and the dual-stream blocks (54) are two
stacks, each split over the P stages (ceil(L/P) slots per device; padded slots hold zeros, whose gates
are zero, so such a block adds nothing to its stream: an exact identity). Two stacks are two passes
(V = 2), V-shaped: up the stages through the refiner slots, straight on at stage P-1 into the dual-stream
slots, back down to stage 0. The patch's step therefore ends on stage 0, which runs the output layer,
CFG and the sampler step, and the updated latent patch never moves (``programs.py``). The refiner is not
given a stage rule of its own: with P > 2 (the released models) some stages hold only padded refiner
slots, whose pass costs one hop of the patch's streams and no block.

Tokens. The joint sequence is [video; prompt; glyph; image] (token groups 0-3 of the model; no image
group in text-to-video). Patch m carries a band of video rows of every latent frame (Wan's
``patch_by="rows"`` split: the tokens stay in patchify order within the band, each carrying its own
RoPE position) and chunk m of each condition group (FLUX's text layout: ceil(T/M) tokens per patch,
padded for the R x U sequence shards, pad tokens masked). The prompt and glyph masks differ per batch row
(the positive and negative prompts have their own lengths): they enter the programs in patch chunks,
replicated over the sequence axes, as ``sample_valid`` (Qwen-Image's prompt mask), so fresh and stale
keys are masked per row.

The refiner attends over the prompt group alone: ``ctx.group_attention`` inside a stage masks the other
groups' keys in the fresh block and in the stale buffer (Z-Image's refiners), exact. Its conditioning
(timestep + the pooled prompt, pooled on the host as in the plain forward) is per step, so the other
patches' prompt K/V it reads in a pipelined step are stale like every other K/V.

Per-token inputs. The transformer's input per video token is the noisy latent, then the condition
channels: zeros for text-to-video, the first frame's latents and mask for image-to-video (the plain
loop's ``token_hooks``): the I2V ``condition`` tokens are taken per patch here, in the same order.

Embeddings (patch, prompt, glyph, image, time, pooled prompt) and the output layer are replicated; every
stage computes the step's two conditioning vectors itself. MeanFlow models (a second timestep) are not
run here yet.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from converters.hunyuan_video15 import CHECKPOINTS
from jaxdit.mesh import ParallelConfig
from jaxdit.models import hunyuan_video15 as hv
from jaxdit.models.hunyuan_video15_config import HunyuanVideo15Config
from jaxdit.models.layers import rope_angles
from jaxdit.pipelines.pipefusion import video_patches
from jaxdit.pipelines.pipefusion.cache import PIPEFUSION_CACHES
from jaxdit.pipelines.pipefusion.geometry import PatchGeometry
from jaxdit.pipelines.pipefusion.stages import StagedModel
from jaxdit.pipelines.pipefusion.video_patches import validate_patches

__all__ = [
    "PASSES",
    "Geometry",
    "HunyuanVideo15Patches",
    "PipeFusionHunyuanVideo15",
    "default_num_patches",
    "validate_patches",
]

#: Passes over the stages per forward: the token refiner (up), the dual-stream blocks (down).
PASSES = len(hv.HunyuanVideo15Transformer.STACKS)
#: The condition groups after the video, by the forward context's names (features, mask).
GROUPS = (
    ("encoder_hidden_states", "encoder_attention_mask"),
    ("encoder_hidden_states_2", "encoder_attention_mask_2"),
    ("image_embeds", "image_embeds_mask"),
)


# --------------------------------------------------------------------------------------------------------
# Checks that need no devices
# --------------------------------------------------------------------------------------------------------


def default_num_patches(stages: int, grid: tuple[int, int, int], sequence_degree: int = 1) -> int:
    """Whole latent rows, as few as keep both passes (refiner up, dual-stream blocks down) full: M >= 2P
    where the rows and the sequence degree allow (:func:`video_patches.default_num_patches`)."""
    return video_patches.default_num_patches(stages, grid, sequence_degree, "rows", PASSES)


def check_model(config: HunyuanVideo15Config, parallel: ParallelConfig) -> None:
    """Heads against ulysses x tensor; both stacks present; no MeanFlow (its second timestep)."""
    parallel.validate_heads(config.num_attention_heads)
    if config.num_layers < 1 or config.num_refiner_layers < 1:
        raise ValueError(
            "PipeFusion for HunyuanVideo 1.5 runs the token refiner up the stages and the dual-stream "
            f"blocks back down; this model has {config.num_refiner_layers} refiner and {config.num_layers} "
            "dual-stream blocks"
        )
    if config.use_meanflow:
        raise ValueError("PipeFusion does not run HunyuanVideo 1.5 MeanFlow models (a second timestep) yet")


class PipeFusionHunyuanVideo15(StagedModel):
    """A HunyuanVideo 1.5 transformer's parameters laid out for PipeFusion: ``refiner_blocks`` and
    ``transformer_blocks`` in stage slots (see ``stages.py``: :meth:`load`, :meth:`from_model`,
    :meth:`abstract`)."""

    checkpoints = CHECKPOINTS
    wrong_family = "{path}: PipeFusion runs HunyuanVideo 1.5 checkpoints here; this one is {family}"
    dtype_param = ("x_embedder", "kernel")
    depth_fields = {"refiner_blocks": "num_refiner_layers", "transformer_blocks": "num_layers"}
    check = staticmethod(check_model)
    abstract_model = staticmethod(hv.abstract_model)


# --------------------------------------------------------------------------------------------------------
# Token geometry of one generation
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Geometry(PatchGeometry):
    """Static sizes of one generation: the (F', H', W') video token grid split into M bands of rows, S =
    ring x ulysses sequence shards, the model batch (both CFG branches), the latent batch, and the
    prompt, glyph and image token counts (image 0: text-to-video). A patch holds [video band; prompt
    chunk; glyph chunk(; image chunk)]."""

    grid: tuple[int, int, int]
    patches: int
    ring: int
    ulysses: int
    batch: int
    requests: int
    text: int
    glyph: int
    image: int = 0

    @property
    def lengths(self) -> tuple[int, ...]:
        """The condition groups' token counts (the image group only where there is one)."""
        return (self.text, self.glyph) + ((self.image,) if self.image else ())

    @property
    def video_tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def pieces(self) -> tuple[int, ...]:
        return (self.latent_piece, *(self.context_piece(n) for n in self.lengths))

    @property
    def latent_piece(self) -> int:
        return self.video_tokens // (self.patches * self.seq)

    def piece_valid(self) -> tuple[np.ndarray | None, ...]:
        groups = [self.context_valid(n) for n in self.lengths]
        return (None, *(None if v.all() else v for v in groups))

    def to_patches(self, x: np.ndarray, axis: int) -> np.ndarray:
        """[..., N, ...] video tokens in patchify (frame, row, column) order -> [..., M, N/M, ...]: patch m
        is the rows [m H'/M, (m+1) H'/M) of every frame."""
        f, h, w = self.grid
        m = self.patches
        lead, rest = x.shape[:axis], x.shape[axis + 1 :]
        y = np.moveaxis(x.reshape(*lead, f, m, h // m, w, *rest), axis + 1, axis)  # [..., M, F, H/M, W]
        return y.reshape(*lead, m, self.video_tokens // m, *rest)

    def from_patches(self, x: np.ndarray, axis: int) -> np.ndarray:
        """Inverse of :meth:`to_patches`."""
        f, h, w = self.grid
        m = self.patches
        lead, rest = x.shape[:axis], x.shape[axis + 2 :]
        y = np.moveaxis(x.reshape(*lead, m, f, h // m, w, *rest), axis, axis + 1)
        return y.reshape(*lead, self.video_tokens, *rest)


# --------------------------------------------------------------------------------------------------------
# The family: HunyuanVideo 1.5's staged pieces on patches, for the runner
# --------------------------------------------------------------------------------------------------------


class _Pieces:
    """HunyuanVideo 1.5's embedders and conditioning on one generation's patches (inside the program)."""

    def __init__(self, model: hv.HunyuanVideo15Transformer, context: dict, g: Geometry, full: bool, batch):
        c = model.config
        self.model, self.batch = model, batch
        self.pooled = context["pooled_projections"]
        groups = [context[name] for name, _ in GROUPS]  # [b, M, S*t, C] each (image None: T2V)
        self.condition = context.get("condition")  # I2V: [b_requests, M, n, K'] beside the noise
        self.extra = (c.in_channels - c.out_channels) * math.prod(c.patch)
        rope = lambda ids: rope_angles(ids, c.rope_axes_dim, c.rope_theta)
        ids = context["video_ids"]  # [M, n, 3]
        if full:  # every patch at once: [video of every patch; prompt of every patch; ...] on this device
            flat = lambda x: None if x is None else x.reshape(x.shape[0], -1, x.shape[-1])
            groups, self.condition = [flat(x) for x in groups], flat(self.condition)
            self.angles = rope(ids.reshape(-1, 3))[None]  # [1, M*n, D/2]
        else:
            self.angles = jax.vmap(rope)(ids)  # [M, n, D/2]
        self.prompt, self.glyph, self.image = groups
        # [b, M, S*t] replicated over the sequence axes -> [b, M, S, t]: each row's real tokens per piece.
        split = lambda m: m.reshape(m.shape[0], g.patches, g.seq, -1)
        masks = [split(context[mask]) for _, mask in GROUPS[:2]]
        self.sample_valid = (None, *masks) + (() if self.image is None else (None,))

    def step_cond(self, timestep: jax.Array) -> tuple[jax.Array, jax.Array]:
        t = jnp.full((self.pooled.shape[0],), timestep, jnp.float32)
        return self.model.step_conditioning(t, self.pooled)

    def embed(self, x: jax.Array, patch: jax.Array | None) -> tuple[Any, ...]:
        pick = lambda a: a if a is None or patch is None else lax.dynamic_index_in_dim(a, patch, 1, False)
        if self.condition is not None:  # I2V: the first frame's latents and mask beside the noise
            x = jnp.concatenate([x, pick(self.condition).astype(x.dtype)], -1)
        else:  # T2V: zero condition latents and a zero mask
            x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], self.extra), x.dtype)], -1)
        tokens = self.batch(x).astype(self.model.dtype)
        return self.model.embed_tokens(tokens, pick(self.prompt), pick(self.glyph), pick(self.image))

    def cond(self, step: tuple[jax.Array, jax.Array], patch: jax.Array | None) -> hv.HunyuanVideo15Cond:
        angles = self.angles if patch is None else self.angles[patch][None]
        return hv.HunyuanVideo15Cond(*step, angles)

    def prediction(self, pred: jax.Array) -> jax.Array:
        return pred  # features (c, t, h, w): the latent tokens' own order (patchify's)


@dataclasses.dataclass(frozen=True)
class HunyuanVideo15Patches:
    """What the PipeFusion runner asks of HunyuanVideo 1.5 (``family.PatchFamily``), for a model ``config``.

    Program context: the condition groups in patch chunks (``encoder_hidden_states`` [B, M, S*t, C],
    ``encoder_hidden_states_2`` [B, M, S*g, C2], I2V's ``image_embeds`` [B, M, S*i, C3]), the prompt and
    glyph masks chunked alike but replicated over the sequence axes ([B, M, S*t]), the pooled prompt
    [B, C], the video tokens' ``video_ids`` [M, n, 3] and I2V's ``condition`` tokens [B_requests, M, n,
    K'] in patches.
    """

    config: HunyuanVideo15Config

    #: The feature caches this runner takes (host-planned: ``pipefusion/cache.py``).
    caches = PIPEFUSION_CACHES

    context_axes = {
        "encoder_hidden_states": ("batch", None, "seq", None),
        "encoder_attention_mask": ("batch", None, None),
        "encoder_hidden_states_2": ("batch", None, "seq", None),
        "encoder_attention_mask_2": ("batch", None, None),
        "image_embeds": ("batch", None, "seq", None),
        "pooled_projections": ("batch", None),
        "video_ids": (None, "seq", None),
        "condition": ("request", None, "seq", None),
    }

    @property
    def width(self) -> int:
        return self.config.hidden_size

    @property
    def latent_features(self) -> int:
        return self.config.output_features

    def default_patches(self, grid: tuple[int, int, int], parallel: ParallelConfig) -> int:
        return default_num_patches(parallel.pipefusion, grid, parallel.sequence_degree)

    def validate_patches(self, grid: tuple[int, int, int], patches: int, parallel: ParallelConfig) -> None:
        validate_patches(grid, patches, parallel.sequence_degree)

    def geometry(
        self,
        grid: tuple[int, int, int],
        patches: int,
        parallel: ParallelConfig,
        requests: int,
        context: Mapping,
    ) -> Geometry:
        batch, text = np.shape(context["encoder_hidden_states"])[:2]
        glyph = np.shape(context["encoder_hidden_states_2"])[1]
        image = 0 if context.get("image_embeds") is None else np.shape(context["image_embeds"])[1]
        pc = parallel
        return Geometry(tuple(grid), patches, pc.ring, pc.ulysses, batch, requests, text, glyph, image)

    def program_context(self, context: Mapping, g: Geometry, dtype: Any) -> dict[str, tuple | None]:
        out: dict[str, tuple | None] = {}
        for (name, mask), length in zip(GROUPS, (g.text, g.glyph, g.image), strict=True):
            if not length:
                out[name] = None
                continue
            out[name] = (g.pad_context(np.asarray(context[name], np.float32), 1, length), dtype)
            if mask in self.context_axes:
                rows = len(context[mask])
                chunks = g.pad_context(np.asarray(context[mask], bool), 1, length).reshape(
                    rows, g.patches, -1
                )
                out[mask] = (chunks, jnp.bool_)
        condition = context.get("condition")
        out["pooled_projections"] = (np.asarray(context["pooled_projections"], np.float32), dtype)
        out["video_ids"] = (g.to_patches(np.asarray(context["video_ids"], np.float32), 0), jnp.float32)
        out["condition"] = (
            None if condition is None else (g.to_patches(np.asarray(condition, np.float32), 1), jnp.float32)
        )
        return out

    def abstract_context(self, g: Geometry, dtype: Any) -> dict[str, tuple | None]:
        c, m, s = self.config, g.patches, g.seq
        t, gl = g.context_piece(g.text), g.context_piece(g.glyph)
        n = g.video_tokens // m
        return {
            "encoder_hidden_states": ((g.batch, m, s * t, c.text_embed_dim), dtype),
            "encoder_attention_mask": ((g.batch, m, s * t), jnp.bool_),
            "encoder_hidden_states_2": ((g.batch, m, s * gl, c.text_embed_2_dim), dtype),
            "encoder_attention_mask_2": ((g.batch, m, s * gl), jnp.bool_),
            "image_embeds": ((g.batch, m, s * g.context_piece(g.image), c.image_embed_dim), dtype)
            if g.image
            else None,
            "pooled_projections": ((g.batch, c.text_embed_dim), dtype),
            "video_ids": ((m, n, 3), jnp.float32),
            "condition": ((g.requests, m, n, c.input_features - c.output_features), jnp.float32)
            if g.image
            else None,
        }

    def pieces(
        self, model: nnx.Module, context: dict, g: Geometry, *, full: bool, batch: Callable
    ) -> _Pieces:
        return _Pieces(model, context, g, full, batch)
