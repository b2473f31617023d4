"""FLUX.1 with PipeFusion (arXiv 2405.14430): how FLUX's tokens and stacks meet the runner.

Stages. FLUX runs 19 double-stream blocks, then 38 single-stream blocks, each a stacked array whose
layer axis the ``PIPEFUSION`` rule splits over the ``pipefusion`` mesh axis. Splitting the concatenated
57 blocks into P contiguous stages (xDiT) would give devices different block types, which one SPMD
program with evenly split arrays cannot hold without padding a whole stack per device. So both stacks
are split over all P devices: each device holds ceil(19/P) double and ceil(38/P) single slots (padded
slots hold zeros, which FLUX's AdaLN gates turn into an exact identity), and a patch makes two passes
over the devices, V-shaped: up through the double blocks (stage 0 -> P-1), straight on at stage P-1
into the single blocks, back down to stage 0. The last virtual stage therefore sits on stage 0, the one
that starts the patch's next step, and the updated latent patch never moves. Per device that is 1/P of
both stacks; per tick every device runs its double slots on one patch and its single slots on another.
A patch returns to stage 0 after 2P ticks, so num_pipeline_patch >= 2P keeps the pipeline full (the
default when the rows allow); P <= M < 2P runs with 2P - M idle ticks per step.

Embeddings and the final layer. Embedders (img_in, txt_in, time/guidance/pooled MLPs) and the final
layer are replicated (0.5% of flux-dev's parameters). Every stage needs the conditioning vector for its
blocks' AdaLN: each device computes it itself, for every step once per call, which is cheaper than
sending it; the patch is embedded on stage 0 and the final layer + sampler step run there too.

Text tokens. The joint sequence is [text; image], and the text stream is updated by every double
block. The text tokens are split over the patches as the image rows are: patch m carries text chunk m
(T/M tokens, padded and masked), so every micro-step has the same shape, no text work is repeated and
text K/V become fresh chunk by chunk like image K/V (xDiT instead sends the whole text with patch 0,
which in SPMD would make every tick carry and compute it). With Ulysses/Ring inside a stage each patch
is further split over the R x U sequence shards as in the plain sequence-parallel step.

K/V buffers. Per layer slot, post-RoPE K and V of every patch, after Ulysses' all_to_all (this device's
heads, every token of the sequence), in the model dtype: [slots, B, M, S*(t+n), H/(tensor*U), D].

Precision. As the plain model: the residual streams are fp32, so the activations a stage sends are fp32
(sending them in bf16 would round the stream at every stage boundary, which the serial model does not).
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

from converters.flux import CHECKPOINTS
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux
from jaxdit.models.layers import rope_angles
from jaxdit.pipelines.pipefusion import runner
from jaxdit.pipelines.pipefusion.cache import PIPEFUSION_CACHES
from jaxdit.pipelines.pipefusion.geometry import PatchGeometry
from jaxdit.pipelines.pipefusion.programs import PipeFusionPrograms
from jaxdit.pipelines.pipefusion.stages import StagedModel
from jaxdit.samplers import flow_match_euler as euler
from jaxdit.samplers.sampler import EulerSampler

__all__ = [
    "PASSES",
    "STACKS",
    "FluxPatches",
    "Geometry",
    "PipeFusionFlux",
    "collective_bytes",
    "default_num_patches",
    "lower",
    "make_programs",
    "padded_config",
    "validate_patches",
]

STACKS = flux.FluxTransformer.STACKS
#: Passes over the stages per forward: the double blocks (up), then the single blocks (down).
PASSES = len(STACKS)
#: The sampler FLUX.1 [dev] ships with: flow-matching Euler, shift by the image token count.
DEFAULT_SCHEDULER = euler.FlowMatchEulerConfig(
    shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15
)


# --------------------------------------------------------------------------------------------------------
# Checks that need no devices
# --------------------------------------------------------------------------------------------------------


def default_num_patches(stages: int, rows: int) -> int:
    """2P patches (a full pipeline) when they divide the ``rows`` of packed tokens, else P."""
    return PASSES * stages if rows % (PASSES * stages) == 0 else stages


def validate_patches(rows: int, cols: int, patches: int, sequence_degree: int) -> None:
    """Patches are whole rows of packed 2x2 tokens, and each patch's tokens split over ring x ulysses."""
    if patches < 1 or rows % patches:
        valid = [m for m in range(1, rows + 1) if rows % m == 0]
        raise ValueError(
            f"num_pipeline_patch={patches} does not divide the {rows} rows of the latent after patchify "
            f"(2x2 patches); patches are whole rows: use one of {', '.join(map(str, valid))}"
        )
    per_patch = rows // patches * cols
    if per_patch % sequence_degree:
        raise ValueError(
            f"each of the {patches} patches has {per_patch} image tokens ({rows // patches} rows x {cols}), "
            f"which ring x ulysses = {sequence_degree} does not divide; use fewer patches or another "
            "sequence degree"
        )


def _check_model(config: flux.FluxConfig, parallel: ParallelConfig) -> None:
    parallel.validate_heads(config.num_heads)
    if config.depth < 1 or config.depth_single_blocks < 1:
        raise ValueError(
            f"PipeFusion for FLUX runs the double blocks up the stages and the single blocks back down; "
            f"this model has {config.depth} double and {config.depth_single_blocks} single blocks"
        )


# --------------------------------------------------------------------------------------------------------
# The model laid out in stages
# --------------------------------------------------------------------------------------------------------


class PipeFusionFlux(StagedModel):
    """A FLUX transformer's parameters laid out for PipeFusion on ``mesh``: stacks in stage slots.

    The stacked ``double_blocks``/``single_blocks`` hold ``P x ceil(L/P)`` slots in V order (see the
    module docstring), split over ``pipefusion`` by ``rules_for(pipefusion=P)``: this is not a plain
    ``FluxTransformer`` any more. Build it with :meth:`from_model` (re-lays out arrays), :meth:`load`
    (straight from a FLUX checkpoint, BFL or diffusers safetensors, each device reading its own slots;
    heads, stacks and degrees are checked before a tensor is read) or :meth:`abstract` (shapes only).
    """

    checkpoints = CHECKPOINTS
    wrong_family = "{path}: PipeFusion runs FLUX checkpoints; this one is {family}"
    dtype_param = ("img_in", "kernel")
    depth_fields = {"double_blocks": "depth", "single_blocks": "depth_single_blocks"}
    check = staticmethod(_check_model)
    abstract_model = staticmethod(flux.abstract_model)


def padded_config(config: flux.FluxConfig, stages: int) -> flux.FluxConfig:
    """The config whose stacks have P x ceil(L/P) slots (the stage layout's parameter container)."""
    return PipeFusionFlux.padded(config, stages)


# --------------------------------------------------------------------------------------------------------
# Token geometry of one generation
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Geometry(PatchGeometry):
    """Static sizes of one generation: T text tokens, rows x cols packed image tokens, M patches, S
    sequence shards (ring x ulysses), the model batch (both CFG branches) and the latent batch. A patch
    holds [text chunk; image rows], and with R > 0 reference tokens (FLUX.1 Kontext) a reference chunk
    after them: reference tokens are context like the text, split over the patches the same way (each
    computed once per step, in its patch's micro-step), never latents the sampler steps."""

    text: int
    rows: int
    cols: int
    patches: int
    ring: int
    ulysses: int
    batch: int
    requests: int
    reference: int = 0

    @property
    def text_patch(self) -> int:
        return self.chunk(self.text)

    @property
    def text_piece(self) -> int:
        """Text tokens per (patch, sequence shard) piece: a patch's text is padded to S of them."""
        return self.context_piece(self.text)

    @property
    def reference_piece(self) -> int:
        return self.context_piece(self.reference)

    @property
    def image_piece(self) -> int:
        return self.rows * self.cols // (self.patches * self.seq)

    @property
    def pieces(self) -> tuple[int, ...]:
        return (self.text_piece, self.image_piece) + ((self.reference_piece,) if self.reference else ())

    @property
    def latent_piece(self) -> int:
        return self.image_piece

    def text_valid(self, length: int | None = None) -> np.ndarray:
        """[M, S, t] bool: which padded text tokens (or of a context group of ``length``) are real."""
        return self.context_valid(self.text if length is None else length)

    def piece_valid(self) -> tuple[np.ndarray | None, ...]:
        groups = [self.text_valid(), None] + ([self.text_valid(self.reference)] if self.reference else [])
        return tuple(None if v is None or v.all() else v for v in groups)

    def pad_text(self, x: np.ndarray, axis: int, length: int | None = None) -> np.ndarray:
        """[..., T, ...] -> [..., M, S*t, ...] along ``axis``: the text's (or a context group of ``length``
        tokens: Kontext's reference) per-patch chunks, each padded for S shards."""
        return self.pad_context(x, axis, self.text if length is None else length)

    def to_patches(self, x: np.ndarray, axis: int) -> np.ndarray:
        """Packed image tokens in row-major order: patch m is the contiguous rows [m rows/M, ...)."""
        return x.reshape(*x.shape[:axis], self.patches, -1, *x.shape[axis + 1 :])

    def from_patches(self, x: np.ndarray, axis: int) -> np.ndarray:
        return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


# --------------------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------------------


def collective_bytes(
    g: Geometry, parallel: ParallelConfig, hidden: int, out_channels: int, dtype: Any, true_cfg: bool
) -> dict[str, int]:
    """Bytes one device sends through PipeFusion's and CFG's collective-permutes (the busiest device).

    ``activation``: one patch's fp32 residual stream [B, t+n, E] (this device's piece); ``tick``: per
    pipeline tick, one activation up the stages (double blocks), one down (single blocks) and, with
    cfg=2, one branch's prediction of the patch; ``step``: M ticks (an asynchronous step in the steady
    state); ``warmup_step``: the full sequence P-1 hops up and P-1 down, plus cfg's exchange of the whole
    prediction; ``cfg_tick``: cfg's part of a tick. Latents and K/V never move. ``dtype`` is the dtype
    the prediction moves in (the model's; f32 for bf16 models on the CPU backend).
    """
    batch = g.batch // (parallel.data * parallel.cfg)
    act = batch * g.piece * hidden * 4
    p = parallel.pipefusion
    cfg_patch = batch * g.image_piece * out_channels * jnp.dtype(dtype).itemsize if parallel.cfg == 2 else 0
    per_tick = (2 * act if p > 1 else 0) + cfg_patch
    return {
        "activation": act,
        "tick": per_tick,
        "step": g.patches * per_tick,
        "warmup_step": (2 * (p - 1) * act * g.patches) + cfg_patch * g.patches,
        "cfg_tick": cfg_patch,
    }


# --------------------------------------------------------------------------------------------------------
# The family: FLUX's staged pieces on patches, for the runner
# --------------------------------------------------------------------------------------------------------


class _Pieces:
    """FLUX's own embedders and conditioning on one generation's patches (inside the program)."""

    def __init__(self, model: flux.FluxTransformer, context: dict, g: Geometry, full: bool, batch: Callable):
        self.model, self.batch = model, batch
        self.pooled, self.guidance = context["pooled_projections"], context["guidance"]
        text, ref = context["encoder_hidden_states"], context.get("reference_hidden_states")
        ids = [context[n] for n in ("txt_ids", "img_ids", "reference_ids") if context.get(n) is not None]
        rope = lambda ids: rope_angles(ids, model.config.axes_dim, model.config.theta)
        flat = lambda x: None if x is None else x.reshape(x.shape[0], -1, x.shape[-1])
        if full:  # every patch: [text of every patch; image of every patch(; reference)] on this device
            self.text, self.ref = flat(text), flat(ref)
            self.angles = rope(g.full_layout().join_local([i.reshape(-1, 3) for i in ids], axis=0))[None]
        else:
            self.text, self.ref = text, ref  # [B, M, t, C']: patch m's text (and reference) chunk
            join = lambda *groups: g.patch_layout().join_local(list(groups), axis=0)
            self.angles = rope(jax.vmap(join)(*ids))  # [M, t+n(+r), D/2]

    def step_cond(self, sigma: jax.Array) -> jax.Array:
        t = jnp.full((self.pooled.shape[0],), sigma, jnp.float32)
        return self.model.conditioning(t, self.pooled, self.guidance)

    def embed(self, x: jax.Array, patch: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        chunk = lambda c: c if c is None or patch is None else lax.dynamic_index_in_dim(c, patch, 1, False)
        return self.model.embed_tokens(
            self.batch(x).astype(self.model.dtype), chunk(self.text), chunk(self.ref)
        )

    def cond(self, vec: jax.Array, patch: jax.Array | None) -> flux.FluxCond:
        return flux.FluxCond(vec, self.angles if patch is None else self.angles[patch][None])

    def prediction(self, pred: jax.Array) -> jax.Array:
        return pred


@dataclasses.dataclass(frozen=True)
class FluxPatches:
    """What the PipeFusion runner asks of FLUX (``family.PatchFamily``), for a model ``config``.

    The programs' context is the forward context by diffusers' names, laid out in patches: patch m's
    padded text chunk (``encoder_hidden_states`` [B, M, S*t, C'], ``txt_ids`` [M, S*t, 3]) and image
    positions (``img_ids`` [M, S*n, 3]); ``pooled_projections`` and ``guidance`` (dev) as they are.
    """

    config: flux.FluxConfig

    #: The feature caches this runner takes (host-planned: ``pipefusion/cache.py``).
    caches = PIPEFUSION_CACHES

    context_axes = {
        "encoder_hidden_states": ("batch", None, "seq", None),
        "pooled_projections": ("batch", None),
        "guidance": ("batch",),
        "txt_ids": (None, "seq", None),
        "img_ids": (None, "seq", None),
        "reference_hidden_states": ("batch", None, "seq", None),  # Kontext: chunks like the text's
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
            "pooled_projections": (f32("pooled_projections"), dtype),
            "guidance": None if guidance is None else (f32("guidance"), jnp.float32),
            "txt_ids": (g.pad_text(f32("txt_ids"), 0), jnp.float32),
            "img_ids": (g.to_patches(f32("img_ids"), 0), jnp.float32),
            "reference_hidden_states": ref and (g.pad_text(f32("reference_hidden_states"), 1, r), dtype),
            "reference_ids": ref and (g.pad_text(f32("reference_ids"), 0, r), jnp.float32),
        }

    def abstract_context(self, g: Geometry, dtype: Any) -> dict[str, tuple | None]:
        c, m, s, r = self.config, g.patches, g.seq, g.reference_piece
        return {
            "encoder_hidden_states": ((g.batch, m, s * g.text_piece, c.context_in_dim), dtype),
            "pooled_projections": ((g.batch, c.vec_in_dim), dtype),
            "guidance": ((g.batch,), jnp.float32) if c.guidance_embed else None,
            "txt_ids": ((m, s * g.text_piece, 3), jnp.float32),
            "img_ids": ((m, s * g.image_piece, 3), jnp.float32),
            "reference_hidden_states": g.reference and ((g.batch, m, s * r, c.in_channels), dtype) or None,
            "reference_ids": g.reference and ((m, s * r, 3), jnp.float32) or None,
        }

    def pieces(
        self, model: nnx.Module, context: dict, g: Geometry, *, full: bool, batch: Callable
    ) -> _Pieces:
        return _Pieces(model, context, g, full, batch)


# --------------------------------------------------------------------------------------------------------
# Programs from abstract shapes
# --------------------------------------------------------------------------------------------------------


def make_programs(
    model: PipeFusionFlux,
    g: Geometry,
    true_cfg: bool = False,
    *,
    kernel: Mapping[str, int] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> PipeFusionPrograms:
    """The warm-up step and pipelined phase of ``g`` (compiled lazily), with FLUX's Euler sampler."""
    family, sampler = FluxPatches(model.config), EulerSampler(DEFAULT_SCHEDULER)
    return PipeFusionPrograms(family, model, g, true_cfg, sampler, kernel, compiler_options)


def lower(
    model: PipeFusionFlux,
    geometry: Geometry,
    *,
    steps: int,
    warmup_steps: int = 1,
    true_cfg: bool = False,
    kernel: Mapping[str, int] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> tuple[jax.stages.Lowered, jax.stages.Lowered | None]:
    """The warm-up step and the pipelined phase (None when ``warmup_steps == steps``) lowered from
    abstract shapes: full-size compiles, collectives and memory without weights."""
    programs = make_programs(model, geometry, true_cfg, kernel=kernel, compiler_options=compiler_options)
    schedule = programs.sampler.schedule(steps, image_seq_len=geometry.rows * geometry.cols)
    return runner.lower(programs, schedule, steps=steps, warmup_steps=warmup_steps)
