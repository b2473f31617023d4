"""Wan 2.1 with PipeFusion (arXiv 2405.14430): video sampling pipelined over layer stages.

``jaxdit.parallel.pipefusion`` has the model-independent machinery (schedule, stale-K/V attention, the
permute), ``pipefusion_stages`` the parameters in stage slots and ``pipefusion_programs`` what the
compiled programs of every family share; this module is Wan's stage glue and the pipeline around it
(``pipefusion_flux`` is FLUX's).

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
of every patch after Ulysses' all_to_all: [slots, B, M, n, H/(tensor U), D], in the carry.

Sampler state per patch. UniPC's state (last sample, the two previous data predictions) is elementwise
in the tokens, so the state of patch m is the [:, m] slice of three arrays shaped like the latents; the
step index of a tick's item is static in the schedule (warm-up steps + the item's step). The last stage
holds the authoritative latents and state and updates patch m's slices when patch m leaves the pipeline;
stage 0 keeps a copy of the latents that it refreshes from the permuted patch. With warmup_steps equal
to the number of steps every step is the serial step on all patches at once, so the result equals
``WanPipeline``'s.

Phases. ``warmup_steps`` synchronous steps (one jitted call each): the full sequence goes up the stages
and fills every buffer; then ONE jitted call runs the remaining steps as a ``lax.scan`` over ticks.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from converters.wan import CHECKPOINTS
from jaxdit.mesh import ParallelConfig
from jaxdit.models import wan
from jaxdit.models.layers import layer_norm, rope_angles, timestep_embedding
from jaxdit.parallel.cfg import interleave_branches
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.parallel.pipefusion import (
    PIPE_AXIS,
    shift,
    stage_layer_order,
    validate_pipefusion,
    write_patch,
)
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.assemble import preset_check
from jaxdit.pipelines.base import GenerationOutput
from jaxdit.pipelines.denoiser import abstract_like
from jaxdit.pipelines.denoiser import progress_bar as _progress
from jaxdit.pipelines.pipefusion_programs import StagePrograms
from jaxdit.pipelines.pipefusion_stages import StagedModel
from jaxdit.pipelines.wan import check_inputs, swap_features
from jaxdit.samplers import unipc

__all__ = [
    "PASSES",
    "Geometry",
    "PipeFusionWan",
    "PipeFusionWanPipeline",
    "collective_bytes",
    "default_num_patches",
    "lower",
    "validate_patches",
]

#: One pass over the stages per forward (one stack of blocks).
PASSES = 1
STACK = "blocks"
SEQ = ("ring", "ulysses")
PATCH_AXES = {"frames": 0, "rows": 1}


# --------------------------------------------------------------------------------------------------------
# Checks that need no devices
# --------------------------------------------------------------------------------------------------------


def _split_size(grid: tuple[int, int, int], patch_by: str) -> int:
    if patch_by not in PATCH_AXES:
        raise ValueError(f"patch_by must be 'rows' or 'frames', got {patch_by!r}")
    return grid[PATCH_AXES[patch_by]]


def default_num_patches(stages: int, grid: tuple[int, int, int], sequence_degree: int = 1, patch_by="rows"):
    """The smallest M >= P (a full pipeline: V = 1) that splits the rows (frames) into whole patches whose
    tokens the sequence degree divides; P when none does (the checks then say why)."""
    size = _split_size(grid, patch_by)
    for m in range(stages, size + 1):
        if size % m == 0 and (math.prod(grid) // m) % sequence_degree == 0:
            return m
    return stages


def validate_patches(
    grid: tuple[int, int, int], patches: int, sequence_degree: int, patch_by: str = "rows"
) -> None:
    """Patches are whole latent rows (or frames) after patchify, and ring x ulysses splits each."""
    size = _split_size(grid, patch_by)
    what = "rows" if patch_by == "rows" else "frames"
    f, h, w = grid
    if patches < 1 or size % patches:
        valid = [m for m in range(1, size + 1) if size % m == 0]
        raise ValueError(
            f"num_pipeline_patch={patches} does not divide the {size} latent {what} after patchify "
            f"(token grid {f} frames x {h} rows x {w} columns); patches are whole {what}: use one of "
            f"{', '.join(map(str, valid))}"
        )
    per_patch = math.prod(grid) // patches
    if per_patch % sequence_degree:
        raise ValueError(
            f"each of the {patches} patches has {per_patch} video tokens, which ring x ulysses = "
            f"{sequence_degree} does not divide (PipeFusion for Wan does not pad patches); use fewer "
            "patches or another sequence degree"
        )


def check_model(config: wan.WanConfig, parallel: ParallelConfig) -> None:
    """Heads against ulysses x tensor; Wan PipeFusion runs T2V and I2V models alike."""
    parallel.validate_heads(config.num_heads)


def padded_config(config: wan.WanConfig, stages: int) -> wan.WanConfig:
    """The config whose stack has P x ceil(L/P) slots (the stage layout's parameter container)."""
    return dataclasses.replace(config, num_layers=stages * -(-config.num_layers // stages))


# --------------------------------------------------------------------------------------------------------
# The model laid out in stages
# --------------------------------------------------------------------------------------------------------


def _orders(config: wan.WanConfig, stages: int) -> dict[str, np.ndarray]:
    return {STACK: stage_layer_order(config.num_layers, stages, 0)}


class PipeFusionWan(StagedModel):
    """A Wan transformer's parameters laid out for PipeFusion on ``mesh``: ``blocks`` in stage slots.

    The stacked ``blocks`` hold P x ceil(L/P) slots (device s: layers of chunk s, in order), split over
    ``pipefusion`` by ``rules_for(pipefusion=P)``; everything else is replicated (or split over
    ``tensor``). Build it with :meth:`from_model`, :meth:`load` or :meth:`abstract`.
    """

    checkpoints = CHECKPOINTS
    wrong_family = "{path}: this is a {family} checkpoint, not Wan 2.1"
    dtype_param = ("patch_embedding", "kernel")
    check = staticmethod(check_model)
    stack_orders = staticmethod(_orders)
    padded = staticmethod(padded_config)
    abstract_model = staticmethod(wan.abstract_model)

    @property
    def order(self) -> np.ndarray:
        """The blocks' slot -> layer (-1: padding)."""
        return self.orders[STACK]

    @classmethod
    def load(
        cls, path: str | Path, mesh: Mesh, dtype: Any = None, *, preset: str | None = None
    ) -> PipeFusionWan:
        """From a Wan checkpoint (diffusers, original or ``jaxdit convert`` safetensors): each device reads
        only its own slots of the stack. Heads and the preset are checked before a tensor is read."""
        pc = ParallelConfig.from_mesh(mesh)
        check_config = preset_check(path, CHECKPOINTS, preset)

        def check(config: Any) -> None:
            if check_config is not None:
                check_config(config)
            check_model(config, pc)

        return cls._load(path, mesh, dtype, check)


# --------------------------------------------------------------------------------------------------------
# Token geometry of one generation
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one generation: the (F', H', W') token grid, M patches split by rows or frames,
    S = ring x ulysses sequence shards, the model batch (both CFG branches), the latent batch, the text
    length (and image tokens for I2V)."""

    grid: tuple[int, int, int]
    patches: int
    ring: int
    ulysses: int
    batch: int
    requests: int
    text: int
    image: int = 0
    patch_by: str = "rows"

    @property
    def seq(self) -> int:
        return self.ring * self.ulysses

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def patch_tokens(self) -> int:
        return self.tokens // self.patches

    @property
    def piece(self) -> int:
        """Tokens of one patch on one sequence shard."""
        return self.patch_tokens // self.seq

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


def _to_slots(x: jax.Array, g: Geometry) -> jax.Array:
    """Warm-up K/V in gathered order [B, S*(M*n), h, D] (shard, patch, token) -> [B, M, S*n, h, D]."""
    b, _, h, d = x.shape
    x = x.reshape(b, g.seq, g.patches, g.piece, h, d)
    return jnp.swapaxes(x, 1, 2).reshape(b, g.patches, g.seq * g.piece, h, d)


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
# The programs (local view inside shard_map)
# --------------------------------------------------------------------------------------------------------


def _schedule_specs() -> unipc.UniPCSchedule:
    return unipc.UniPCSchedule(*(PartitionSpec(),) * 4)


class _Programs(StagePrograms):
    """Wan's warm-up step and asynchronous phase for one geometry, compiled lazily."""

    passes = PASSES

    def __init__(
        self,
        model: PipeFusionWan,
        g: Geometry,
        cfg: bool,
        kernel: tuple,
        compiler_options: Mapping[str, Any] | None,
    ) -> None:
        batch_axes = ("data", "cfg")
        specs = {
            "latents": PartitionSpec(PIPE_AXIS, "data", None, SEQ, None),
            "condition": PartitionSpec(None, "data", None, SEQ, None),
            "text": PartitionSpec(batch_axes, None, None),
            "positions": PartitionSpec(None, SEQ, None),
            "kv": PartitionSpec(PIPE_AXIS, batch_axes, None, None, ("tensor", "ulysses"), None),
            "scalar": PartitionSpec(),
        }
        super().__init__(model, g, cfg, kernel, compiler_options, specs)

    # ------------------------------------------------------------- shapes
    def kv_shape(self) -> tuple[int, ...]:
        g, c = self.g, self.model.config
        return (len(self.model.order), g.batch, g.patches, g.patch_tokens, c.num_heads, c.head_dim)

    def latent_shape(self) -> tuple[int, ...]:
        g = self.g
        return (self.model.stages, g.requests, g.patches, g.patch_tokens, self.model.config.out_features)

    def buffer_shapes(self) -> list[tuple[int, ...]]:
        """K and V."""
        return [self.kv_shape()] * 2

    def abstract_args(self, steps: int | None, total_steps: int) -> tuple:
        """``jax.ShapeDtypeStruct`` arguments of the warm-up step (``steps=None``) or of the pipelined
        phase over ``steps`` steps, for ``.lower(*args)`` without weights or data."""
        g, mdl, sds = self.g, self.model, self.sds
        c, dtype = mdl.config, mdl.dtype
        lat = sds(self.latent_shape(), jnp.float32, "latents")
        extra = c.in_channels - c.out_channels
        cond = (
            sds((g.batch, g.text, c.text_dim), dtype, "text"),
            sds((g.batch, g.image, c.image_dim), dtype, "text") if c.is_i2v else None,
            sds(
                (1, g.requests, g.patches, g.patch_tokens, extra * math.prod(c.patch_size)),
                jnp.float32,
                "condition",
            )
            if c.is_i2v
            else None,
            sds((g.patches, g.patch_tokens, 3), jnp.int32, "positions"),
        )
        n = total_steps
        schedule = unipc.UniPCSchedule(
            sds((n + 1,), jnp.float32, "scalar"),
            sds((n,), jnp.int32, "scalar"),
            sds((n, 4), jnp.float32, "scalar"),
            sds((n, 3), jnp.float32, "scalar"),
        )
        scalar = sds((), jnp.float32, "scalar")
        index = sds((), jnp.int32, "scalar")
        params = self.abstract_params()
        return (params, lat, lat, lat, lat, *self.abstract_buffers(), *cond, schedule, index, scalar)

    # ------------------------------------------------------------- pieces
    def _pieces(self, state: nnx.State, text, image) -> dict[str, Any]:
        model = nnx.merge(self.model.graphdef, state)
        c = self.model.config
        blocks = nnx.split(model.blocks)
        # Text (and image) context: embedded once per call on every device (no timestep in it).
        zero = jnp.zeros((text.shape[0],), jnp.float32)
        _, _, txt, img = model.embed_conditions(zero, text, image)

        def time_vectors(timestep):
            """(temb [B, E], time_mod [B, 6, E]) as ``WanTransformer.embed_conditions`` computes them."""
            t = timestep_embedding(jnp.full((text.shape[0],), timestep, jnp.float32), c.freq_dim)
            temb = wan.fp32_linear(
                model.time_embedding_2, jax.nn.silu(wan.fp32_linear(model.time_embedding_1, t))
            )
            mod = wan.fp32_linear(model.time_projection, jax.nn.silu(temb)).reshape(-1, 6, c.dim)
            return temb, mod

        def head(x, temb):
            shift_, scale = (model.head_modulation[...][None] + temb[:, None, :]).transpose(1, 0, 2)[
                :, :, None
            ]
            h = (layer_norm(x, c.eps) * (1 + scale) + shift_).astype(model.dtype)
            pred = model.head(h).astype(jnp.float32)
            return swap_features(pred, math.prod(c.patch_size), c.out_channels)  # -> token order

        def embed(x, condition):
            tokens = jnp.concatenate([x, condition], -1) if c.is_i2v else x
            return model.patch_embedding(self.model_batch(tokens).astype(model.dtype)).astype(jnp.float32)

        return dict(blocks=blocks, txt=txt, img=img, time=time_vectors, head=head, embed=embed)

    def _run_stack(self, p, x, mod, angles, layout, stale_bufs=None, stale_valid=None):
        """Scan this device's slots; returns the stream and each slot's fresh K/V."""

        def call(block, h, ctx):
            return block(h, mod, p["txt"], p["img"], angles, ctx)

        return self.scan_slots(p["blocks"], x, call, layout, None, stale_bufs, stale_valid)

    def _to_stage0(self, x: jax.Array) -> jax.Array:
        """The last stage's ``x`` on stage 0 (others get zeros); the latent's way back."""
        stages = self.parallel.pipefusion
        return x if stages == 1 else lax.ppermute(x, PIPE_AXIS, [(stages - 1, 0)])

    # ------------------------------------------------------------- warm-up
    def _build_warmup(self) -> Callable:
        g, pc, mdl = self.g, self.parallel, self.model
        stages = pc.pipefusion
        layout = SequenceLayout((g.seq * g.patches * g.piece,), g.seq)

        def local(state, lat, last, x0p, x0p2, kb, vb, text, image, condition, positions, schedule, i, scale):
            p = self._pieces(state, text, image)
            s = lax.axis_index(PIPE_AXIS)
            b, m, n = lat.shape[1], g.patches, g.piece
            flat = lambda a: a[0].reshape(b, m * n, -1)
            x_lat = flat(lat)
            cond_tokens = flat(condition) if condition is not None else None
            angles = rope_angles(
                positions.reshape(m * n, 3), mdl.config.rope_axes_dim, mdl.config.rope_theta
            )[None]
            temb, mod = p["time"](schedule.timesteps[i].astype(jnp.float32))

            def tick(c, position):
                x, kb, vb = c
                y, (k, v) = self._run_stack(p, x, mod, angles, layout)
                active = s == position
                slots = jax.vmap(lambda a: _to_slots(a, g))
                kb = jnp.where(active, slots(k).astype(kb.dtype), kb)
                vb = jnp.where(active, slots(v).astype(vb.dtype), vb)
                return (y, kb, vb)

            carry = (p["embed"](x_lat, cond_tokens), kb, vb)

            def hop(c, position):
                y, kb, vb = tick(c, position)
                return (shift(y, 1, stages), kb, vb), None

            carry, _ = lax.scan(hop, carry, jnp.arange(stages - 1))
            y, kb, vb = tick(carry, stages - 1)  # the output lies on stage P-1
            v_guided = self.guide(p["head"](y, temb), scale)
            sampler = unipc.UniPCState(i, flat(last), flat(x0p), flat(x0p2))
            x_new, sampler = unipc.step(schedule, sampler, x_lat, v_guided)
            x_new = jnp.where(s == 0, self._to_stage0(x_new), x_new)
            shape = lat.shape
            out = (x_new, sampler.last_sample, sampler.x0_prev, sampler.x0_prev2)
            return (*(a.reshape(shape) for a in out), kb, vb)

        return self._jit(local, pipelined=False)

    # ------------------------------------------------------------- asynchronous phase
    def _build_async(self, steps: int, first_step: int) -> Callable:
        g, pc, mdl = self.g, self.parallel, self.model
        stages = pc.pipefusion
        sched = self.schedule(steps)
        layout = SequenceLayout((g.patch_tokens,), g.seq)

        def local(
            state, lat, last, x0p, x0p2, kb, vb, text, image, condition, positions, schedule, i0, scale
        ):
            del i0  # the step index of every item is static: first_step + its step
            p = self._pieces(state, text, image)
            s = lax.axis_index(PIPE_AXIS)
            c = mdl.config
            angles = jax.vmap(lambda pos: rope_angles(pos, c.rope_axes_dim, c.rope_theta))(positions)
            timesteps = schedule.timesteps[first_step : first_step + steps].astype(jnp.float32)
            tembs, mods = jax.vmap(p["time"])(timesteps)  # [steps, B, E], [steps, B, 6, E]
            lat, last, x0p, x0p2 = (a[0] for a in (lat, last, x0p, x0p2))  # [b, M, n, K]
            cond = condition[0] if condition is not None else None
            patches = jnp.arange(g.patches)

            def stale_valid(m):
                return jnp.repeat(patches != m, g.patch_tokens)

            pick = lambda a, m: lax.dynamic_index_in_dim(a, m, 1, keepdims=False)
            put = lambda a, x, m: lax.dynamic_update_index_in_dim(a, x, m, 1)

            def tick(carry, t):
                lat, last, x0p, x0p2, fwd, kb, vb = carry
                ok, step, m = sched.item(t, 0, s)
                x_old = pick(lat, m)
                x_in = jnp.where(s == 0, p["embed"](x_old, None if cond is None else pick(cond, m)), fwd)
                y, (k, v) = self._run_stack(
                    p, x_in, mods[step], angles[m][None], layout, (kb, vb), stale_valid(m)
                )
                kb, vb = write_patch(kb, k, m, ok), write_patch(vb, v, m, ok)

                # The last stage ends the patch's step: head, CFG, UniPC on this patch's state slice.
                v_guided = self.guide(p["head"](y, tembs[step]), scale)
                sampler = unipc.UniPCState(first_step + step, pick(last, m), pick(x0p, m), pick(x0p2, m))
                x_new, sampler = unipc.step(schedule, sampler, x_old, v_guided)
                done = ok & (s == stages - 1)
                keep = lambda new, old: jnp.where(done, new, old)
                lat = put(lat, keep(x_new, x_old), m)
                last = put(last, keep(sampler.last_sample, pick(last, m)), m)
                x0p = put(x0p, keep(sampler.x0_prev, pick(x0p, m)), m)
                x0p2 = put(x0p2, keep(sampler.x0_prev2, pick(x0p2, m)), m)

                # The updated patch goes back to stage 0, which embeds it at the patch's next step.
                if stages > 1:
                    back = self._to_stage0(x_new)
                    ok_r, _, m_r = sched.item(t, 0, jnp.int32(stages - 1))
                    lat = put(lat, jnp.where(ok_r & (s == 0), back, pick(lat, m_r)), m_r)
                fwd = shift(y, 1, stages)
                return (lat, last, x0p, x0p2, fwd, kb, vb), None

            zero = jnp.zeros((text.shape[0], layout.local_length, c.dim), jnp.float32)
            carry = (lat, last, x0p, x0p2, zero, kb, vb)
            (lat, last, x0p, x0p2, *_), _ = lax.scan(tick, carry, jnp.arange(sched.ticks))
            return lat[None]

        return self._jit(local, pipelined=True)

    # ------------------------------------------------------------- jit
    def _jit(self, local, *, pipelined: bool) -> Callable:
        sp = self.specs
        lat = (sp["latents"],) * 4
        kv = (sp["kv"],) * 2
        cond = (sp["text"], sp["text"], sp["condition"], sp["positions"])  # image/condition: I2V only
        in_specs = (*lat, *kv, *cond, _schedule_specs(), sp["scalar"], sp["scalar"])
        out_specs = sp["latents"] if pipelined else (*lat, *kv)
        # Latents, sampler state and (in warm-up) the K/V buffers are updated in place.
        return self.jit(local, in_specs, out_specs, donate_argnums=(1,) if pipelined else (1, 2, 3, 4, 5, 6))


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
    programs = _Programs(model, geometry, cfg, tuple(sorted((kernel or {}).items())), compiler_options)
    warm = programs.warmup().lower(*programs.abstract_args(None, steps))
    rest = steps - warmup_steps
    run = None
    if rest:
        run = programs.asynchronous(rest, warmup_steps).lower(*programs.abstract_args(rest, steps))
    return warm, run


# --------------------------------------------------------------------------------------------------------
# Pipeline
# --------------------------------------------------------------------------------------------------------


class PipeFusionWanPipeline:
    """``WanPipeline``'s call (embeddings, CFG, frames, flow shift, seed) with PipeFusion.

    The request is checked by ``jaxdit.pipelines.wan.check_inputs`` plus the patch checks; the denoising
    loop is the warm-up steps plus one pipelined call (module docstring). ``num_pipeline_patch`` defaults
    to the smallest M >= P that splits the rows (a full pipeline); ``warmup_steps`` to 1 (xDiT's).
    """

    def __init__(
        self,
        model: PipeFusionWan,
        *,
        scheduler: unipc.UniPCConfig | None = None,
        decode: Callable[[np.ndarray], np.ndarray] | None = None,
        vae_scale_factor_spatial: int = 8,
        vae_scale_factor_temporal: int = 4,
        kernel: dict[str, int] | None = None,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.config = model.config
        self.mesh = model.mesh
        self.parallel = model.parallel
        self.scheduler = scheduler
        self.decode = decode
        self.vae_scale_factor_spatial = vae_scale_factor_spatial
        self.vae_scale_factor_temporal = vae_scale_factor_temporal
        self.kernel = tuple(sorted((kernel or {}).items()))
        self.compiler_options = compiler_options
        self._programs: dict[tuple, _Programs] = {}
        #: After a call: (warm-up fn, its abstract args) and (pipelined fn, its abstract args) or None.
        self.last_programs: dict[str, tuple[Callable, tuple] | None] = {}

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        parallel: ParallelConfig | Mesh,
        dtype: Any = None,
        *,
        preset: str | None = None,
        **kwargs: Any,
    ) -> PipeFusionWanPipeline:
        from jaxdit.mesh import mesh_for as _mesh

        return cls(PipeFusionWan.load(path, _mesh(parallel), dtype, preset=preset), **kwargs)

    def programs(self, g: Geometry, cfg: bool) -> _Programs:
        key = (g, cfg)
        if key not in self._programs:
            self._programs[key] = _Programs(self.model, g, cfg, self.kernel, self.compiler_options)
        return self._programs[key]

    def __call__(
        self,
        *,
        prompt_embeds: np.ndarray,
        negative_prompt_embeds: np.ndarray | None = None,
        image_embeds: np.ndarray | None = None,
        condition: np.ndarray | None = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        flow_shift: float | None = None,
        seed: int = 0,
        latents: np.ndarray | None = None,
        output_type: str = "latent",
        progress: bool = True,
        num_pipeline_patch: int | None = None,
        warmup_steps: int = 1,
        patch_by: str = "rows",
    ) -> GenerationOutput:
        """Generate videos (latents [B, 16, F', H/8, W/8]; ``images`` when a decoder is given)."""
        if output_type not in ("np", "latent"):
            raise ValueError(f"output_type must be 'np' or 'latent', got {output_type!r}")
        if output_type == "np" and self.decode is None:
            raise ValueError("this pipeline has no decoder (VAE): use output_type='latent'")
        pc, mc = self.parallel, self.config
        if flow_shift is None and self.scheduler is not None:
            flow_shift = self.scheduler.flow_shift
        txt = np.asarray(prompt_embeds, np.float32)
        neg = None if negative_prompt_embeds is None else np.asarray(negative_prompt_embeds, np.float32)
        plan = check_inputs(
            mc,
            dataclasses.replace(pc, pipefusion=1),  # the blocks' split is this pipeline's business
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            prompt_embeds=txt.shape,
            negative_prompt_embeds=None if neg is None or guidance_scale <= 1.0 else neg.shape,
            image_embeds=None if image_embeds is None else np.shape(image_embeds),
            condition=None if condition is None else np.shape(condition),
            latents=None if latents is None else np.shape(latents),
            flow_shift=flow_shift,
            vae_scale_factor_spatial=self.vae_scale_factor_spatial,
            vae_scale_factor_temporal=self.vae_scale_factor_temporal,
        )
        grid = wan.latent_grid(plan.latent_shape, mc.patch_size)
        patches = num_pipeline_patch or default_num_patches(pc.pipefusion, grid, pc.sequence_degree, patch_by)
        validate_pipefusion(pc.pipefusion, patches, warmup_steps, num_inference_steps)
        validate_patches(grid, patches, pc.sequence_degree, patch_by)

        cfg, batch = plan.cfg, plan.batch
        if cfg:
            txt = np.asarray(interleave_branches(neg, txt, pc.data))
        image = None
        if mc.is_i2v:
            img = np.asarray(image_embeds, np.float32)
            image = np.asarray(interleave_branches(img, img, pc.data)) if cfg else img
        g = Geometry(
            grid,
            patches,
            pc.ring,
            pc.ulysses,
            txt.shape[0],
            batch,
            txt.shape[1],
            0 if image is None else image.shape[1],
            patch_by,
        )
        programs = self.programs(g, cfg)
        sh, dtype = programs.shardings, self.model.dtype

        noise = latent_ops.initial_noise(seed, plan.latent_shape) if latents is None else latents
        tokens = g.to_patches(np.asarray(wan.patchify(np.asarray(noise, np.float32), mc.patch_size)), 1)
        lat = jax.device_put(np.broadcast_to(tokens[None], (pc.pipefusion, *tokens.shape)), sh["latents"])
        zeros = jax.jit(jnp.zeros_like, out_shardings=sh["latents"])
        sampler = [zeros(lat) for _ in range(3)]
        cond_tokens = None
        if mc.is_i2v:
            ct = g.to_patches(np.asarray(wan.patchify(np.asarray(condition, np.float32), mc.patch_size)), 1)
            cond_tokens = jax.device_put(ct[None], sh["condition"])
        positions = g.to_patches(wan.token_positions(grid), 0)
        context = (
            jax.device_put(txt, sh["text"]).astype(dtype),
            None if image is None else jax.device_put(image, sh["text"]).astype(dtype),
            cond_tokens,
            jax.device_put(positions, sh["positions"]),
        )
        scheduler = dataclasses.replace(self.scheduler or unipc.UniPCConfig(), flow_shift=plan.flow_shift)
        schedule = jax.device_put(unipc.set_timesteps(scheduler, num_inference_steps), sh["scalar"])
        scale = jnp.float32(guidance_scale)
        state = self.model.state

        start = time.perf_counter()
        kv = programs.zero_buffers()
        warm = programs.warmup()
        args = (state, lat, *sampler, *kv, *context, schedule, jnp.int32(0), scale)
        self.last_programs = {"warmup": (warm, jax.tree.map(abstract_like, args)), "pipelined": None}
        for i in _progress(range(warmup_steps), progress, warmup_steps):
            lat, *sampler, k, v = warm(state, lat, *sampler, *kv, *context, schedule, jnp.int32(i), scale)
            kv = (k, v)
        remaining = num_inference_steps - warmup_steps
        if remaining:
            run = programs.asynchronous(remaining, warmup_steps)
            args = (state, lat, *sampler, *kv, *context, schedule, jnp.int32(warmup_steps), scale)
            self.last_programs["pipelined"] = (run, jax.tree.map(abstract_like, args))
            lat = run(*args)
        # The last stage's copy is the result (stage 0 holds the same; the others what they computed).
        out = np.asarray(jax.device_get(lat[pc.pipefusion - 1]))
        seconds = time.perf_counter() - start
        tokens = g.from_patches(out, 1)
        tokens = swap_features(tokens, mc.out_channels, math.prod(mc.patch_size))
        out = np.asarray(wan.unpatchify(tokens, grid, mc.patch_size, mc.out_channels))
        video = self.decode(out) if output_type == "np" else None
        return GenerationOutput(images=video, latents=out, seconds=seconds)
