"""Wan (2.1; 2.2 A14B and TI2V-5B) with PipeFusion (arXiv 2405.14430): how Wan's tokens and blocks meet
the runner.

Stages. Wan has one stack of identical blocks: its stacked layer axis is split over ``pipefusion`` by
the ``PIPEFUSION`` rule, ceil(L/P) slots per device (padded slots hold zeros; a zero Wan block adds
exactly zero to the residual stream, its projections being zero). A patch makes one pass up the stages
(V = 1): stage 0 embeds it, stage P-1 runs the head, CFG and the UniPC step and sends the updated
latent patch back to stage 0, a collective-permute of the patch's [b, n, 64] fp32 tokens (at most
1.25% of the activation permute's bytes at Wan's hidden 5120; less when both CFG branches share a
device). The loop from a patch's entry to its next step's entry is P ticks, so M = P patches keep the
pipeline full.

Embeddings, head, sampler. Patch, text and time embeddings and the head are replicated (796 MiB, 2.9%
of wan2.1-t2v-14b's bf16 parameters). Every stage needs the time modulation for its blocks and the
embedded text for their cross-attention: both are computed on every device (the text once per call,
the time vectors of every step once per call), which is cheaper than sending them.

Cross-attention. Its keys and values come from the text (and, for I2V, the image features) only, never
from other video tokens, so a patch's cross-attention is exact without any buffer: each block computes
the context K/V from its own weights when it runs, on whichever stage holds it. That repeats 2 T E^2
multiply-adds per block for every patch, M times per step instead of once; for wan2.1-t2v-14b at 720p x
81 frames (75,600 tokens) and M = 8 the M - 1 extra times add 0.2% to a step's block FLOPs (attention
included). Caching them per block would change the model's block call for those 0.2%.

Patches. The latent is patchified into a (F', H', W') token grid; patch m is the rows
[m H'/M, (m+1) H'/M) of every frame (``patch_by="rows"``, xDiT's split) or the frames
[m F'/M, (m+1) F'/M) (``"frames"``). Tokens are re-ordered on the host into [B, M, n, K] (patch-major);
every op but attention is per token and each token carries its own 3D RoPE position, so the order is
free. With Ring/Ulysses inside a stage each patch's n tokens are split over the S = R x U sequence
shards (S must divide n: no padding). Self-attention K/V buffers, per layer slot, hold post-RoPE K and V
of every patch after Ulysses' all_to_all: [slots, B, M, n, H/(tensor U), D].

Sampler state per patch. UniPC's state (last sample, the two previous data predictions) is elementwise
in the tokens, so the state of patch m is the [:, m] slice of three arrays shaped like the latents. The
last stage holds the authoritative latents and state and updates patch m's slices when patch m leaves
the pipeline; stage 0 keeps a copy of the latents that it refreshes from the permuted patch. With
warmup_steps equal to the number of steps every step is the serial step on all patches at once, so the
result equals ``WanPipeline``'s.

Wan 2.2. A14B's two experts share this layout (the low-noise expert's state is a second staged state with
the same shardings, ``wan_experts.TwoExperts``); the runner runs each expert's steps as a PipeFusion run
of its own (``segments.py``). I2V-A14B reads the condition channels without CLIP features. TI2V-5B with an
image: each patch's first-frame tokens take the given frame in the model input and see timestep 0 (the
embeddings of t and 0 per step, a per-token select in every block and the head), as the plain loop's
``token_hooks`` and ``timestep_mask`` do on the whole sequence.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from converters.wan import CHECKPOINTS
from jaxdit.mesh import DeviceMesh, ParallelConfig
from jaxdit.models import wan
from jaxdit.models.layers import rope_angles
from jaxdit.models.wan_patchify import swap_features
from jaxdit.pipelines.assemble import preset_check
from jaxdit.pipelines.pipefusion import runner
from jaxdit.pipelines.pipefusion.cache import PIPEFUSION_CACHES
from jaxdit.pipelines.pipefusion.geometry import PatchGeometry
from jaxdit.pipelines.pipefusion.programs import PipeFusionPrograms
from jaxdit.pipelines.pipefusion.stages import StagedModel
from jaxdit.pipelines.pipefusion.video_patches import default_num_patches, validate_patches
from jaxdit.samplers import unipc
from jaxdit.samplers.sampler import UniPCSampler

__all__ = [
    "PASSES",
    "Geometry",
    "PipeFusionWan",
    "WanPatches",
    "collective_bytes",
    "default_num_patches",
    "lower",
    "make_programs",
    "padded_config",
    "validate_patches",
]

#: One pass over the stages per forward (one stack of blocks).
PASSES = len(wan.WanTransformer.STACKS)
#: Per-token context entries [B, N, k] beside the latent tokens: I2V's condition channels (mask + image
#: latent), TI2V's first-frame tokens and the 0/1 marks of the tokens it replaces.
PER_TOKEN = ("condition", "first_frame", "in_first_frame")


# --------------------------------------------------------------------------------------------------------
# Checks that need no devices
# --------------------------------------------------------------------------------------------------------


def check_model(config: wan.WanConfig, parallel: ParallelConfig) -> None:
    """Heads against ulysses x tensor; Wan PipeFusion runs T2V, I2V and TI2V models alike."""
    parallel.validate_heads(config.num_heads)


# --------------------------------------------------------------------------------------------------------
# The model laid out in stages
# --------------------------------------------------------------------------------------------------------


class PipeFusionWan(StagedModel):
    """A Wan transformer's parameters laid out for PipeFusion on ``mesh``: ``blocks`` in stage slots.

    The stacked ``blocks`` hold P x ceil(L/P) slots (device s: layers of chunk s, in order), split over
    ``pipefusion`` by ``rules_for(pipefusion=P)``; everything else is replicated (or split over
    ``tensor``). Build it with :meth:`from_model`, :meth:`load` or :meth:`abstract`.
    """

    checkpoints = CHECKPOINTS
    wrong_family = "{path}: this is a {family} checkpoint, not Wan 2.1"
    dtype_param = ("patch_embedding", "kernel")
    depth_fields = {"blocks": "num_layers"}
    check = staticmethod(check_model)
    abstract_model = staticmethod(wan.abstract_model)

    @property
    def order(self) -> np.ndarray:
        """The blocks' slot -> layer (-1: padding)."""
        return self.orders["blocks"]

    @classmethod
    def load(
        cls, path: str | Path, mesh: Mesh, dtype: Any = None, *, preset: str | None = None
    ) -> PipeFusionWan:
        """From a Wan checkpoint (diffusers, original or ``jaxdit convert`` safetensors): each device reads
        only its own slots of the stack. Heads and the preset are checked before a tensor is read."""
        pc = DeviceMesh.of(mesh).parallel
        check_config = preset_check(path, CHECKPOINTS, preset)

        def check(config: Any) -> None:
            if check_config is not None:
                check_config(config)
            check_model(config, pc)

        return cls._load(path, mesh, dtype, check)


def padded_config(config: wan.WanConfig, stages: int) -> wan.WanConfig:
    """The config whose stack has P x ceil(L/P) slots (the stage layout's parameter container)."""
    return PipeFusionWan.padded(config, stages)


# --------------------------------------------------------------------------------------------------------
# Token geometry of one generation
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Geometry(PatchGeometry):
    """Static sizes of one generation: the (F', H', W') token grid, M patches split by rows or frames,
    S = ring x ulysses sequence shards, the model batch (both CFG branches), the latent batch, the text
    length (and CLIP image tokens for Wan 2.1 I2V), whether a first frame is given (TI2V). A patch holds
    video tokens only."""

    grid: tuple[int, int, int]
    patches: int
    ring: int
    ulysses: int
    batch: int
    requests: int
    text: int
    image: int = 0
    patch_by: str = "rows"
    #: Wan 2.2 TI2V with an image: the first latent frame is given (per-token timesteps, see ``_Pieces``).
    first_frame: bool = False

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def patch_tokens(self) -> int:
        return self.tokens // self.patches

    @property
    def pieces(self) -> tuple[int]:
        return (self.patch_tokens // self.seq,)

    @property
    def latent_piece(self) -> int:
        return self.piece

    def piece_valid(self) -> tuple[None]:
        return (None,)  # patches are never padded (validate_patches)

    def to_patches(self, x: np.ndarray, axis: int) -> np.ndarray:
        """[..., N, ...] tokens in patchify (frame, row, col) order -> [..., M, n, ...] along ``axis``."""
        f, h, w = self.grid
        m = self.patches
        lead, rest = x.shape[:axis], x.shape[axis + 1 :]
        if self.patch_by == "frames":
            return x.reshape(*lead, m, self.patch_tokens, *rest)
        y = x.reshape(*lead, f, m, h // m, w, *rest)
        y = np.moveaxis(y, axis + 1, axis)  # [..., M, F, H/M, W, ...]
        return y.reshape(*lead, m, self.patch_tokens, *rest)

    def from_patches(self, x: np.ndarray, axis: int) -> np.ndarray:
        """Inverse of :meth:`to_patches`."""
        f, h, w = self.grid
        m = self.patches
        lead, rest = x.shape[:axis], x.shape[axis + 2 :]
        if self.patch_by == "frames":
            return x.reshape(*lead, self.tokens, *rest)
        y = x.reshape(*lead, m, f, h // m, w, *rest)
        y = np.moveaxis(y, axis, axis + 1)
        return y.reshape(*lead, self.tokens, *rest)


# --------------------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------------------


def collective_bytes(
    g: Geometry, parallel: ParallelConfig, config: wan.WanConfig, cfg: bool
) -> dict[str, int]:
    """Bytes one device sends through PipeFusion's and CFG's collective-permutes (the busiest device).

    ``activation``: one patch's fp32 residual stream [b, n, E] (this device's piece); ``latent``: the
    updated latent patch [b_latent, n, C*p] fp32 from the last stage to stage 0; ``cfg_tick``: with
    cfg=2, one branch's fp32 prediction of the patch; ``tick`` = activation + latent + cfg_tick (every
    device issues each permute every tick); ``step``: M ticks; ``warmup_step``: the full sequence P-1
    hops up, the whole latent back to stage 0 and cfg's exchange of the whole prediction. K/V never
    moves.
    """
    p = parallel.pipefusion
    batch = g.batch // (parallel.data * parallel.cfg)
    requests = g.requests // parallel.data
    act = batch * g.piece * config.dim * 4
    latent = requests * g.piece * config.out_features * 4 if p > 1 else 0
    cfg_patch = batch * g.piece * config.out_features * 4 if cfg and parallel.cfg == 2 else 0
    per_tick = (act if p > 1 else 0) + latent + cfg_patch
    return {
        "activation": act,
        "latent": latent,
        "cfg_tick": cfg_patch,
        "tick": per_tick,
        "step": g.patches * per_tick,
        "warmup_step": g.patches * ((p - 1) * act + latent + cfg_patch),
    }


# --------------------------------------------------------------------------------------------------------
# The family: Wan's staged pieces on patches, for the runner
# --------------------------------------------------------------------------------------------------------


class _Pieces:
    """Wan's own embeddings, conditioning and head order on one generation's patches (in the program).

    The per-token inputs of the plain loop (``jaxdit.pipelines.wan_token_hooks`` and the forward's
    ``timestep_mask``) are taken per patch here, in the same order: I2V's condition channels are
    concatenated beside the noise; TI2V's first frame replaces the first latent frame's tokens of the
    model input (the sampler keeps updating the latents themselves, as in the plain loop), and each token
    of a patch is modulated by the embedding of t or of 0 (``timestep_mask``: 1 sees t).
    """

    def __init__(self, model: wan.WanTransformer, context: dict, g: Geometry, full: bool, batch: Callable):
        c = model.config
        self.model, self.batch, self.full = model, batch, full
        # The cross-attention context: embedded once per call on every device (no timestep in it).
        self.text, self.image = model.embed_context(
            context["encoder_hidden_states"], context["encoder_hidden_states_image"]
        )
        rope = lambda positions: rope_angles(positions, c.rope_axes_dim, c.rope_theta)
        positions = context["positions"]  # [M, n, 3]
        # Per-token arrays [b, M, n, k] (condition, first frame and where it goes) and the mask [M, n].
        self.per_token = {name: context[name] for name in PER_TOKEN if context[name] is not None}
        self.timestep_mask = context["timestep_mask"]
        if full:  # every patch on this device, patch-major
            self.angles = rope(positions.reshape(-1, 3))[None]  # [1, M*n, D/2]
            self.per_token = {k: a.reshape(a.shape[0], -1, a.shape[-1]) for k, a in self.per_token.items()}
            if self.timestep_mask is not None:
                self.timestep_mask = self.timestep_mask.reshape(-1)
        else:
            self.angles = jax.vmap(rope)(positions)  # [M, n, D/2]

    def _of_patch(self, name: str, patch: jax.Array | None) -> jax.Array:
        a = self.per_token[name]
        return a if patch is None else lax.dynamic_index_in_dim(a, patch, 1, False)

    def step_cond(self, timestep: jax.Array) -> tuple[jax.Array, jax.Array]:
        t = jnp.full((self.text.shape[0],), timestep, jnp.float32)
        if self.timestep_mask is None:
            return self.model.embed_time(t)
        # Per-token timesteps: the embeddings of t and of 0, stacked; each patch's tokens pick in ``cond``.
        temb, time_mod, _ = self.model.embed_token_time(t, self.timestep_mask)
        return temb, time_mod

    def embed(self, x: jax.Array, patch: jax.Array | None) -> jax.Array:
        if "condition" in self.per_token:  # I2V: the mask and first-frame latent beside the noise
            x = jnp.concatenate([x, self._of_patch("condition", patch)], -1)
        elif "first_frame" in self.per_token:  # TI2V: the given first frame in place (an exact select)
            given = self._of_patch("in_first_frame", patch) > 0
            x = jnp.where(given, self._of_patch("first_frame", patch), x)
        return self.model.patch_embedding(self.batch(x).astype(self.model.dtype)).astype(jnp.float32)

    def cond(self, time: tuple[jax.Array, jax.Array], patch: jax.Array | None) -> wan.WanCond:
        angles = self.angles if patch is None else self.angles[patch][None]
        token_time = None
        if self.timestep_mask is not None:
            mask = self.timestep_mask if patch is None else self.timestep_mask[patch]
            token_time = (mask > 0)[None, :, None]  # [1, n, 1], as the forward's ``embed_token_time``
        return wan.WanCond(*time, self.text, self.image, angles, token_time)

    def prediction(self, pred: jax.Array) -> jax.Array:
        c = self.model.config
        return swap_features(pred, math.prod(c.patch_size), c.out_channels)  # head (p, c) -> token (c, p)


@dataclasses.dataclass(frozen=True)
class WanPatches:
    """What the PipeFusion runner asks of Wan (``family.PatchFamily``), for a model ``config``.

    The programs' context is the forward context by diffusers' names: the text (and CLIP image) context
    whole for every patch, the video tokens' ``positions`` [M, n, 3] in patches and, for I2V (Wan 2.1
    and 2.2 A14B), the ``condition`` tokens [B, M, n, K'] (mask and first-frame latent, concatenated to
    the noise); for TI2V with an image, the ``first_frame`` tokens [B, M, n, K] and ``in_first_frame``
    marks [B, M, n, 1] of the tokens they replace, and the per-token ``timestep_mask`` [M, n].
    """

    config: wan.WanConfig

    #: The feature caches this runner takes (host-planned: ``pipefusion/cache.py``).
    caches = PIPEFUSION_CACHES

    context_axes = {
        "encoder_hidden_states": ("batch", None, None),
        "encoder_hidden_states_image": ("batch", None, None),
        "positions": (None, "seq", None),
        "timestep_mask": (None, "seq"),
        **{name: ("request", None, "seq", None) for name in PER_TOKEN},
    }

    @property
    def width(self) -> int:
        return self.config.dim

    @property
    def latent_features(self) -> int:
        return self.config.out_features

    def default_patches(
        self, grid: tuple[int, int, int], parallel: ParallelConfig, patch_by: str = "rows"
    ) -> int:
        return default_num_patches(parallel.pipefusion, grid, parallel.sequence_degree, patch_by)

    def validate_patches(
        self, grid: tuple[int, int, int], patches: int, parallel: ParallelConfig, patch_by: str = "rows"
    ) -> None:
        validate_patches(grid, patches, parallel.sequence_degree, patch_by)

    def geometry(
        self,
        grid: tuple[int, int, int],
        patches: int,
        parallel: ParallelConfig,
        requests: int,
        context: Mapping,
        patch_by: str = "rows",
    ) -> Geometry:
        batch, text = np.shape(context["encoder_hidden_states"])[:2]
        image = context.get("encoder_hidden_states_image")
        images, pc = (0 if image is None else np.shape(image)[1]), parallel
        first = context.get("first_frame") is not None
        return Geometry(
            tuple(grid), patches, pc.ring, pc.ulysses, batch, requests, text, images, patch_by, first
        )

    def program_context(self, context: Mapping, g: Geometry, dtype: Any) -> dict[str, tuple | None]:
        image, mask = context.get("encoder_hidden_states_image"), context.get("timestep_mask")
        per_token = {
            name: None
            if context.get(name) is None
            else (g.to_patches(np.asarray(context[name], np.float32), 1), jnp.float32)
            for name in PER_TOKEN
        }
        return {
            "encoder_hidden_states": (np.asarray(context["encoder_hidden_states"], np.float32), dtype),
            "encoder_hidden_states_image": None if image is None else (np.asarray(image, np.float32), dtype),
            "positions": (g.to_patches(np.asarray(context["positions"], np.int32), 0), jnp.int32),
            "timestep_mask": None
            if mask is None
            else (g.to_patches(np.asarray(mask, np.float32), 0), jnp.float32),
            **per_token,
        }

    def abstract_context(self, g: Geometry, dtype: Any) -> dict[str, tuple | None]:
        c = self.config
        tokens = (g.requests, g.patches, g.patch_tokens)
        condition = c.condition_channels * math.prod(c.patch_size)  # I2V: beside CLIP or without (2.2)
        first = g.first_frame
        return {
            "encoder_hidden_states": ((g.batch, g.text, c.text_dim), dtype),
            "encoder_hidden_states_image": ((g.batch, g.image, c.image_dim), dtype) if c.is_i2v else None,
            "positions": ((g.patches, g.patch_tokens, 3), jnp.int32),
            "timestep_mask": ((g.patches, g.patch_tokens), jnp.float32) if first else None,
            "condition": ((*tokens, condition), jnp.float32) if condition else None,
            "first_frame": ((*tokens, c.out_features), jnp.float32) if first else None,
            "in_first_frame": ((*tokens, 1), jnp.float32) if first else None,
        }

    def pieces(
        self, model: nnx.Module, context: dict, g: Geometry, *, full: bool, batch: Callable
    ) -> _Pieces:
        return _Pieces(model, context, g, full, batch)


# --------------------------------------------------------------------------------------------------------
# Programs from abstract shapes
# --------------------------------------------------------------------------------------------------------


def make_programs(
    model: PipeFusionWan,
    g: Geometry,
    cfg: bool = False,
    *,
    kernel: Mapping[str, int] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> PipeFusionPrograms:
    """The warm-up step and pipelined phase of ``g`` (compiled lazily), with Wan's UniPC sampler."""
    family, sampler = WanPatches(model.config), UniPCSampler(unipc.UniPCConfig())
    return PipeFusionPrograms(family, model, g, cfg, sampler, kernel, compiler_options)


def lower(
    model: PipeFusionWan,
    geometry: Geometry,
    *,
    steps: int,
    warmup_steps: int = 1,
    cfg: bool = False,
    kernel: Mapping[str, int] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> tuple[jax.stages.Lowered, jax.stages.Lowered | None]:
    """The warm-up step and the pipelined phase (None when ``warmup_steps == steps``) lowered from
    abstract shapes: full-size compiles, collectives and memory without weights."""
    programs = make_programs(model, geometry, cfg, kernel=kernel, compiler_options=compiler_options)
    return runner.lower(programs, programs.sampler.schedule(steps), steps=steps, warmup_steps=warmup_steps)
