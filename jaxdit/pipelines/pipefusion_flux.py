"""FLUX.1 with PipeFusion (arXiv 2405.14430): text-to-image sampling pipelined over layer stages.

``jaxdit.parallel.pipefusion`` has the model-independent machinery (schedule, stale-K/V attention, the
permute), ``pipefusion_stages`` the parameters in stage slots and ``pipefusion_programs`` what the
compiled programs of every family share; this module is FLUX's stage glue and the pipeline around it.

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
blocks' AdaLN, and recomputing it from the step's sigma on each device is cheaper than sending it; the
patch is embedded on stage 0 and the final layer + sampler step run there too.

Text tokens. The joint sequence is [text; image], and the text stream is updated by every double
block. The text tokens are split over the patches as the image rows are: patch m carries text chunk m
(T/M tokens, padded and masked), so every micro-step has the same shape, no text work is repeated and
text K/V become fresh chunk by chunk like image K/V (xDiT instead sends the whole text with patch 0,
which in SPMD would make every tick carry and compute it). With Ulysses/Ring inside a stage each patch
is further split over the R x U sequence shards as in the plain sequence-parallel step.

K/V buffers. Per layer slot, post-RoPE K and V of every patch, after Ulysses' all_to_all (this device's
heads, every token of the sequence), in the model dtype: [slots, B, M, S*(t+n), H/(tensor*U), D]. They
live in the scan carry and are written one patch slot at a time; they never cross devices.

Precision. As the plain model: the residual streams are fp32, so the activations a stage sends are fp32
(sending them in bf16 would round the stream at every stage boundary, which the serial model does not).

Phases. ``warmup_steps`` synchronous steps (one jitted call each, like ``FluxPipeline``): the full
sequence goes up and down the stages (each device busy 1/P of the time, as xDiT's warm-up, "degrading to
a serial execution") and fills every buffer. Then ONE jitted call runs all remaining steps as a
``lax.scan`` over pipeline ticks: steps flow into each other, with bubbles only at the two ends.
"""

from __future__ import annotations

import dataclasses
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

from converters.flux import CHECKPOINTS
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux
from jaxdit.models.layers import rope_angles
from jaxdit.parallel.cfg import interleave_branches
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.parallel.pipefusion import (
    PIPE_AXIS,
    PipeSchedule,
    shift,
    stage_layer_order,
    validate_pipefusion,
    write_patch,
)
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.denoiser import abstract_like
from jaxdit.pipelines.flux import Decoder, Encoder, FluxPipeline, GenerationOutput
from jaxdit.pipelines.pipefusion_programs import StagePrograms
from jaxdit.pipelines.pipefusion_stages import StagedModel
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.samplers import flow_match_euler as euler

__all__ = [
    "PASSES",
    "Geometry",
    "PipeFusionFlux",
    "PipeFusionFluxPipeline",
    "collective_bytes",
    "default_num_patches",
    "lower",
    "padded_config",
    "tiny_digits",
    "validate_patches",
]

#: Passes over the stages per forward: the double blocks (up), then the single blocks (down).
PASSES = 2
STACKS = ("double_blocks", "single_blocks")
SEQ = ("ring", "ulysses")


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


def padded_config(config: flux.FluxConfig, stages: int) -> flux.FluxConfig:
    """The config whose stacks have P x ceil(L/P) slots (the stage layout's parameter container)."""
    pad = lambda n: stages * -(-n // stages)
    return dataclasses.replace(
        config, depth=pad(config.depth), depth_single_blocks=pad(config.depth_single_blocks)
    )


def _orders(config: flux.FluxConfig, stages: int) -> dict[str, np.ndarray]:
    return {
        "double_blocks": stage_layer_order(config.depth, stages, 0),
        "single_blocks": stage_layer_order(config.depth_single_blocks, stages, 1),
    }


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
    check = staticmethod(_check_model)
    stack_orders = staticmethod(_orders)
    padded = staticmethod(padded_config)
    abstract_model = staticmethod(flux.abstract_model)


# --------------------------------------------------------------------------------------------------------
# Token geometry of one generation
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one generation: T text tokens, rows x cols packed image tokens, M patches, S
    sequence shards (ring x ulysses), the model batch (both CFG branches) and the latent batch."""

    text: int
    rows: int
    cols: int
    patches: int
    ring: int
    ulysses: int
    batch: int
    requests: int

    @property
    def seq(self) -> int:
        return self.ring * self.ulysses

    @property
    def text_patch(self) -> int:
        """Text tokens per patch: the text is padded to M of them (independent of the sequence degree,
        so that every mesh sees the same patches and the same stale K/V)."""
        return -(-self.text // self.patches)

    @property
    def text_piece(self) -> int:
        """Text tokens per (patch, sequence shard) piece: a patch's text is padded to S of them."""
        return -(-self.text_patch // self.seq)

    @property
    def image_piece(self) -> int:
        return self.rows * self.cols // (self.patches * self.seq)

    @property
    def piece(self) -> int:
        return self.text_piece + self.image_piece

    def patch_layout(self) -> SequenceLayout:
        """Local [text; image] of one patch on one device (join/split for the blocks)."""
        return SequenceLayout((self.seq * self.text_piece, self.seq * self.image_piece), self.seq)

    def full_layout(self) -> SequenceLayout:
        """Local [text of every patch; image of every patch] on one device (warm-up)."""
        m = self.patches
        return SequenceLayout((self.seq * m * self.text_piece, self.seq * m * self.image_piece), self.seq)

    def text_valid(self) -> np.ndarray:
        """[M, S, t] bool: which padded text tokens are real (patch m, shard s, token i holds text token
        m * T/M + s * t + i)."""
        m, s, t, tp = self.patches, self.seq, self.text_piece, self.text_patch
        j = np.arange(s * t).reshape(s, t)
        return (j < tp)[None] & (np.arange(m)[:, None, None] * tp + j[None] < self.text)

    def pad_text(self, x: np.ndarray, axis: int) -> np.ndarray:
        """[..., T, ...] -> [..., M, S*t, ...] along ``axis``: per-patch chunks, each padded for S shards."""
        m, tp = self.patches, self.text_patch
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, m * tp - self.text)
        x = np.pad(x, widths).reshape(*x.shape[:axis], m, tp, *x.shape[axis + 1 :])
        widths = [(0, 0)] * x.ndim
        widths[axis + 1] = (0, self.seq * self.text_piece - tp)
        return np.pad(x, widths)

    def patch_valid(self) -> np.ndarray:
        """[M, R, U*(t+n)]: per patch, the real keys of each ring position's gathered block."""
        tv = self.text_valid()
        img = np.ones((self.patches, self.seq, self.image_piece), bool)
        return np.concatenate([tv, img], -1).reshape(self.patches, self.ring, -1)

    def buffer_valid(self) -> np.ndarray:
        """[M, S*(t+n)]: real keys of the buffer's patch slots (slot order: patch, shard, [text; image])."""
        return self.patch_valid().reshape(self.patches, -1)

    def full_valid(self) -> np.ndarray:
        """[R, U*M*(t+n)]: real keys of the gathered full sequence in warm-up order (shard, [text; image])."""
        tv = self.text_valid().transpose(1, 0, 2).reshape(self.seq, -1)  # [S, M*t]
        img = np.ones((self.seq, self.patches * self.image_piece), bool)
        return np.concatenate([tv, img], -1).reshape(self.ring, -1)


def _to_slots(x: jax.Array, g: Geometry) -> jax.Array:
    """Warm-up K/V in gathered order [B, S*(M*t + M*n), h, D] -> buffer order [B, M, S*(t+n), h, D]."""
    b, _, h, d = x.shape
    m, s, t, n = g.patches, g.seq, g.text_piece, g.image_piece
    x = x.reshape(b, s, m * t + m * n, h, d)
    txt = x[:, :, : m * t].reshape(b, s, m, t, h, d)
    img = x[:, :, m * t :].reshape(b, s, m, n, h, d)
    x = jnp.concatenate([txt, img], axis=3)  # [B, S, M, t+n, h, D]
    return jnp.swapaxes(x, 1, 2).reshape(b, m, s * (t + n), h, d)


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
# The programs (local view inside shard_map)
# --------------------------------------------------------------------------------------------------------


class _Programs(StagePrograms):
    """FLUX's warm-up step and asynchronous phase for one geometry, compiled lazily."""

    passes = PASSES

    def __init__(
        self,
        model: PipeFusionFlux,
        g: Geometry,
        true_cfg: bool,
        kernel: tuple,
        compiler_options: Mapping[str, Any] | None,
    ) -> None:
        batch_axes = ("data", "cfg")
        specs = {
            "latents": PartitionSpec(PIPE_AXIS, "data", None, SEQ, None),
            "text": PartitionSpec(batch_axes, None, SEQ, None),
            "pooled": PartitionSpec(batch_axes, None),
            "guidance": PartitionSpec(batch_axes),
            "txt_ids": PartitionSpec(None, SEQ, None),
            "img_ids": PartitionSpec(None, SEQ, None),
            "kv": PartitionSpec(PIPE_AXIS, batch_axes, None, None, ("tensor", "ulysses"), None),
            "scalar": PartitionSpec(),
        }
        super().__init__(model, g, true_cfg, kernel, compiler_options, specs)

    # ------------------------------------------------------------- shapes
    def kv_shape(self, stack: str) -> tuple[int, ...]:
        g, cfg = self.g, self.model.config
        slots = len(self.model.orders[stack])
        return (slots, g.batch, g.patches, g.seq * g.piece, cfg.num_heads, cfg.head_dim)

    def buffer_shapes(self) -> list[tuple[int, ...]]:
        """The four K/V buffers: double K, V; single K, V."""
        return [self.kv_shape(s) for s in STACKS for _ in range(2)]

    def abstract_args(self, steps: int | None) -> tuple:
        """``jax.ShapeDtypeStruct`` arguments of the warm-up step (``steps=None``) or of the pipelined
        phase over ``steps`` steps, for ``.lower(*args)`` without weights or data."""
        g, mdl, sds = self.g, self.model, self.sds
        cfg, dtype = mdl.config, mdl.dtype
        m, s = g.patches, g.seq
        lat = sds((mdl.stages, g.requests, m, s * g.image_piece, cfg.in_channels), jnp.float32, "latents")
        cond = (
            sds((g.batch, m, s * g.text_piece, cfg.context_in_dim), dtype, "text"),
            sds((g.batch, cfg.vec_in_dim), dtype, "pooled"),
            sds((g.batch,), jnp.float32, "guidance") if cfg.guidance_embed else None,
            sds((m, s * g.text_piece, 3), jnp.float32, "txt_ids"),
            sds((m, s * g.image_piece, 3), jnp.float32, "img_ids"),
        )
        scalar = sds((), jnp.float32, "scalar")
        sigmas = (scalar, scalar) if steps is None else (sds((steps + 1,), jnp.float32, "scalar"),)
        return (self.abstract_params(), lat, *self.abstract_buffers(), *cond, *sigmas, scalar)

    # ------------------------------------------------------------- pieces
    def _pieces(self, state: nnx.State, text, pooled, guidance) -> dict[str, Any]:
        model = nnx.merge(self.model.graphdef, state)
        stacks = {name: nnx.split(getattr(model, name)) for name in STACKS}

        def vec(sigma):
            t = jnp.full((pooled.shape[0],), sigma, jnp.float32)
            return model.conditioning(t, pooled, guidance)

        return dict(model=model, stacks=stacks, vec=vec)

    def _run_stack(self, stacks, name, carry, call, layout, fresh_valid, stale_bufs=None, stale_valid=None):
        """Scan this device's slots of a stack; returns the stream and each slot's fresh K/V."""
        return self.scan_slots(stacks[name], carry, call, layout, fresh_valid, stale_bufs, stale_valid)

    # ------------------------------------------------------------- warm-up
    # ------------------------------------------------------------- warm-up
    def _build_warmup(self) -> Callable:
        g, pc, mdl = self.g, self.parallel, self.model
        stages = pc.pipefusion
        layout = g.full_layout()
        full_valid = g.full_valid()

        def local(
            state, lat, kd, vd, ks, vs, text, pooled, guidance, txt_ids, img_ids, sigma, sigma_next, scale
        ):
            p = self._pieces(state, text, pooled, guidance)
            model, stacks = p["model"], p["stacks"]
            s = lax.axis_index(PIPE_AXIS)
            dtype = mdl.dtype
            m, t, n = g.patches, g.text_piece, g.image_piece
            x_lat = lat[0].reshape(lat.shape[1], m * n, -1)
            img = model.img_in(self.model_batch(x_lat).astype(dtype)).astype(jnp.float32)
            txt = model.txt_in(text.reshape(text.shape[0], m * t, -1)).astype(jnp.float32)
            ids = layout.join_local([txt_ids.reshape(m * t, 3), img_ids.reshape(m * n, 3)], axis=0)
            angles = rope_angles(ids, mdl.config.axes_dim, mdl.config.theta)[None]
            vec = p["vec"](sigma)
            valid = jnp.asarray(full_valid)

            def doubles(x):
                def call(block, c, ctx):
                    return block(c[0], c[1], vec, angles, ctx)

                (tx, im), (k, v) = self._run_stack(
                    stacks, "double_blocks", tuple(layout.split_local(x)), call, layout, valid
                )
                return layout.join_local([tx, im]), k, v

            def singles(x):
                (y, (k, v)) = self._run_stack(
                    stacks, "single_blocks", x, lambda b, c, ctx: b(c, vec, angles, ctx), layout, valid
                )
                return y, k, v

            def tick(run, x, kb, vb, position, pass_index, send):
                y, k, v = run(x)
                slots = jax.vmap(lambda a: _to_slots(a, g))
                active = PipeSchedule(stages, g.patches, PASSES, 1).position(pass_index, s) == position
                kb = jnp.where(active, slots(k).astype(kb.dtype), kb)
                vb = jnp.where(active, slots(v).astype(vb.dtype), vb)
                return (shift(y, 1 if pass_index == 0 else -1, stages) if send else y), kb, vb

            def run_pass(run, x, kb, vb, pass_index):
                def body(c, position):
                    return tick(run, *c, position, pass_index, True), None

                (x, kb, vb), _ = lax.scan(body, (x, kb, vb), jnp.arange(stages - 1))
                return tick(run, x, kb, vb, stages - 1, pass_index, False)

            x = layout.join_local([txt, img])
            x, kd, vd = run_pass(doubles, x, kd, vd, 0)  # ends on stage P-1, which starts the singles
            x, ks, vs = run_pass(singles, x, ks, vs, 1)  # ends on stage 0
            pred = model.final_layer(layout.split_local(x)[1], vec)
            v_guided = self.guide(pred, scale)
            x_lat = euler.step(x_lat, v_guided.astype(jnp.float32), sigma, sigma_next)
            return x_lat.reshape(lat.shape), kd, vd, ks, vs

        return self._jit(local, with_sigma_pair=True)

    # ------------------------------------------------------------- asynchronous phase
    def _build_async(self, steps: int) -> Callable:
        g, pc, mdl = self.g, self.parallel, self.model
        stages = pc.pipefusion
        sched = self.schedule(steps)
        layout = g.patch_layout()
        patch_valid, buffer_valid = g.patch_valid(), g.buffer_valid()

        def local(state, lat, kd, vd, ks, vs, text, pooled, guidance, txt_ids, img_ids, sigmas, scale):
            p = self._pieces(state, text, pooled, guidance)
            model, stacks = p["model"], p["stacks"]
            s = lax.axis_index(PIPE_AXIS)
            dtype = mdl.dtype
            ids = jax.vmap(lambda a, b: layout.join_local([a, b], axis=0))(txt_ids, img_ids)
            angles = rope_angles(ids, mdl.config.axes_dim, mdl.config.theta)  # [M, t+n, D/2]
            pv, bv = jnp.asarray(patch_valid), jnp.asarray(buffer_valid)
            lat = lat[0]  # [B, M, n, C]: meaningful on stage 0 only

            def stale_valid(m):
                return (bv & (jnp.arange(g.patches) != m)[:, None]).reshape(-1)

            def embed(lat, m):
                x = lax.dynamic_index_in_dim(lat, m, 1, keepdims=False)
                img = model.img_in(self.model_batch(x).astype(dtype)).astype(jnp.float32)
                txt = model.txt_in(lax.dynamic_index_in_dim(text, m, 1, keepdims=False)).astype(jnp.float32)
                return layout.join_local([txt, img])

            def tick(carry, t):
                lat, fwd, bwd, kd, vd, ks, vs = carry
                # Pass 0, up the stages: the double blocks on patch m_a (stage 0 embeds it first).
                ok_a, step_a, m_a = sched.item(t, 0, s)
                vec_a, ang_a = p["vec"](sigmas[step_a]), angles[m_a][None]
                x = jnp.where(s == 0, embed(lat, m_a), fwd)

                def call_d(block, c, ctx):
                    return block(c[0], c[1], vec_a, ang_a, ctx)

                (tx, im), (k, v) = self._run_stack(
                    stacks,
                    "double_blocks",
                    tuple(layout.split_local(x)),
                    call_d,
                    layout,
                    pv[m_a],
                    (kd, vd),
                    stale_valid(m_a),
                )
                y_d = layout.join_local([tx, im])
                kd, vd = write_patch(kd, k, m_a, ok_a), write_patch(vd, v, m_a, ok_a)

                # Pass 1, down the stages: the single blocks on patch m_b (stage P-1 takes its own output).
                ok_b, step_b, m_b = sched.item(t, 1, s)
                vec_b, ang_b = p["vec"](sigmas[step_b]), angles[m_b][None]
                y_s, (k, v) = self._run_stack(
                    stacks,
                    "single_blocks",
                    bwd,
                    lambda b, c, ctx: b(c, vec_b, ang_b, ctx),
                    layout,
                    pv[m_b],
                    (ks, vs),
                    stale_valid(m_b),
                )
                ks, vs = write_patch(ks, k, m_b, ok_b), write_patch(vs, v, m_b, ok_b)

                # Stage 0 ends the patch's step: final layer, CFG, Euler; the latent stays here.
                pred = model.final_layer(layout.split_local(y_s)[1], vec_b)
                v_guided = self.guide(pred, scale).astype(jnp.float32)
                x_old = lax.dynamic_index_in_dim(lat, m_b, 1, keepdims=False)
                x_new = euler.step(x_old, v_guided, sigmas[step_b], sigmas[step_b + 1])
                x_new = jnp.where(ok_b & (s == 0), x_new, x_old)
                lat = lax.dynamic_update_index_in_dim(lat, x_new, m_b, 1)

                fwd = shift(y_d, 1, stages)
                bwd = jnp.where(s == stages - 1, y_d, shift(y_s, -1, stages))
                return (lat, fwd, bwd, kd, vd, ks, vs), None

            b = text.shape[0]
            zero = jnp.zeros((b, layout.local_length, mdl.config.hidden_size), jnp.float32)
            carry = (lat, zero, zero, kd, vd, ks, vs)
            (lat, *_), _ = lax.scan(tick, carry, jnp.arange(sched.ticks))
            return lat[None]

        return self._jit(local, with_sigma_pair=False, pipelined=True)

    # ------------------------------------------------------------- jit
    def _jit(self, local, *, with_sigma_pair: bool, pipelined: bool = False) -> Callable:
        sp = self.specs
        kv = (sp["kv"],) * 4
        cond = (sp["text"], sp["pooled"], sp["guidance"], sp["txt_ids"], sp["img_ids"])
        sig = (sp["scalar"], sp["scalar"]) if with_sigma_pair else (sp["scalar"],)
        in_specs = (sp["latents"], *kv, *cond, *sig, sp["scalar"])
        out_specs = sp["latents"] if pipelined else (sp["latents"], *kv)
        # Latents (and, in warm-up, the K/V buffers) are updated in place.
        return self.jit(local, in_specs, out_specs, donate_argnums=(1,) if pipelined else (1, 2, 3, 4, 5))


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
    programs = _Programs(model, geometry, true_cfg, tuple(sorted((kernel or {}).items())), compiler_options)
    warm = programs.warmup().lower(*programs.abstract_args(None))
    rest = steps - warmup_steps
    run = programs.asynchronous(rest).lower(*programs.abstract_args(rest)) if rest else None
    return warm, run


# --------------------------------------------------------------------------------------------------------
# Pipeline
# --------------------------------------------------------------------------------------------------------


class PipeFusionFluxPipeline(FluxPipeline):
    """``FluxPipeline``'s call (prompts or embeddings, true CFG, seed, output type) with PipeFusion.

    Reuses ``FluxPipeline``'s request checks and conditioning; the denoising loop is the warm-up steps
    plus one pipelined call (see the module docstring). ``num_pipeline_patch`` defaults to 2P when it
    divides the latent rows (a full pipeline), else P; ``warmup_steps`` to 1 (xDiT's default).
    """

    def __init__(
        self,
        model: PipeFusionFlux,
        *,
        scheduler: euler.FlowMatchEulerConfig | None = None,
        encode: Encoder | None = None,
        decode: Decoder | None = None,
        latent_channels: int = 16,
        vae_scale_factor: int = 8,
        kernel: dict[str, int] | None = None,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> None:
        # Not FluxPipeline.__init__: its plain sharded forward needs every layer on every device.
        self.model = model
        self.mesh = model.mesh
        self.parallel = model.parallel
        self.scheduler = scheduler or euler.FlowMatchEulerConfig(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15
        )
        self.encode = encode
        self.decode = decode
        self.latent_channels = latent_channels
        self.vae_scale_factor = vae_scale_factor
        self.kernel = tuple(sorted((kernel or {}).items()))
        self.compiler_options = compiler_options
        self._programs: dict[tuple, _Programs] = {}
        #: After a call: (warm-up fn, its abstract args) and (pipelined fn, its abstract args) or None.
        self.last_programs: dict[str, tuple[Callable, tuple] | None] = {}

    def programs(self, g: Geometry, true_cfg: bool) -> _Programs:
        key = (g, true_cfg)
        if key not in self._programs:
            self._programs[key] = _Programs(self.model, g, true_cfg, self.kernel, self.compiler_options)
        return self._programs[key]

    def __call__(
        self,
        prompt: str | list[str] | None = None,
        *,
        prompt_embeds: np.ndarray | None = None,
        pooled_prompt_embeds: np.ndarray | None = None,
        negative_prompt: str | list[str] | None = None,
        negative_prompt_embeds: np.ndarray | None = None,
        negative_pooled_prompt_embeds: np.ndarray | None = None,
        height: int = 1024,
        width: int = 1024,
        num_inference_steps: int = 28,
        guidance_scale: float = 3.5,
        true_cfg_scale: float = 1.0,
        seed: int = 0,
        output_type: str = "np",
        progress: bool = True,
        num_pipeline_patch: int | None = None,
        warmup_steps: int = 1,
    ) -> GenerationOutput:
        """Generate images; ``num_pipeline_patch`` and ``warmup_steps`` as xDiT's flags."""
        if output_type not in ("np", "latent"):
            raise ValueError(f"output_type must be 'np' or 'latent', got {output_type!r}")
        if output_type == "np" and self.decode is None:
            raise ValueError("this pipeline has no decoder (VAE): use output_type='latent'")
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        pc, cfg = self.parallel, self.model.config
        h, w = self.latent_size(height, width)
        rows, cols = h // 2, w // 2
        patches = num_pipeline_patch or default_num_patches(pc.pipefusion, rows)
        validate_pipefusion(pc.pipefusion, patches, warmup_steps, num_inference_steps)
        validate_patches(rows, cols, patches, pc.sequence_degree)

        r = GenerationRequest()
        txt, pooled = self._conditioning(prompt, prompt_embeds, pooled_prompt_embeds, r)
        has_negative = negative_prompt is not None or negative_prompt_embeds is not None
        true_cfg = has_negative and true_cfg_scale > 1.0
        self.check_cfg(true_cfg)
        if true_cfg:
            neg_txt, neg_pooled = self._conditioning(
                negative_prompt, negative_prompt_embeds, negative_pooled_prompt_embeds, r, txt.shape[0]
            )
            if neg_txt.shape != txt.shape:
                raise ValueError(
                    f"negative prompt embeddings {neg_txt.shape} differ from the prompt's {txt.shape}"
                )
            txt = np.asarray(interleave_branches(neg_txt, txt, pc.data))
            pooled = np.asarray(interleave_branches(neg_pooled, pooled, pc.data))
        batch = txt.shape[0] // (2 if true_cfg else 1)
        if batch % pc.data:
            raise ValueError(f"{batch} images cannot be split over data={pc.data}")
        g = Geometry(txt.shape[1], rows, cols, patches, pc.ring, pc.ulysses, txt.shape[0], batch)
        programs = self.programs(g, true_cfg)
        sh, dtype = programs.shardings, self.model.dtype

        noise = latent_ops.initial_noise(seed, (batch, self.latent_channels, h, w))
        x = latent_ops.pack(noise).reshape(batch, patches, rows * cols // patches, -1)
        lat = jax.device_put(np.broadcast_to(x[None], (pc.pipefusion, *x.shape)), sh["latents"])
        text = g.pad_text(txt, 1)
        txt_ids = g.pad_text(latent_ops.text_positions(g.text), 0)
        img_ids = latent_ops.image_positions(h, w).reshape(patches, -1, 3)
        cond = (
            jax.device_put(text, sh["text"]).astype(dtype),
            jax.device_put(pooled, sh["pooled"]).astype(dtype),
            jax.device_put(np.full((txt.shape[0],), guidance_scale, np.float32), sh["guidance"])
            if cfg.guidance_embed
            else None,
            jax.device_put(txt_ids, sh["txt_ids"]),
            jax.device_put(img_ids, sh["img_ids"]),
        )
        mu = euler.flux_mu(rows * cols) if self.scheduler.use_dynamic_shifting else None
        schedule = euler.set_timesteps(self.scheduler, sigmas=euler.flux_sigmas(num_inference_steps), mu=mu)
        sigmas = jnp.asarray(schedule.sigmas, jnp.float32)
        scale = jnp.float32(true_cfg_scale)
        state = self.model.state

        start = time.perf_counter()
        kv = programs.zero_buffers()
        warm = programs.warmup()
        args = (state, lat, *kv, *cond, sigmas[0], sigmas[1], scale)
        self.last_programs = {"warmup": (warm, jax.tree.map(abstract_like, args)), "pipelined": None}
        for i in _progress(range(warmup_steps), progress, warmup_steps):
            lat, *kv = warm(state, lat, *kv, *cond, sigmas[i], sigmas[i + 1], scale)
        remaining = num_inference_steps - warmup_steps
        if remaining:
            run = programs.asynchronous(remaining)
            args = (state, lat, *kv, *cond, sigmas[warmup_steps:], scale)
            self.last_programs["pipelined"] = (run, jax.tree.map(abstract_like, args))
            lat = run(*args)
        # Stage 0's copy is the result (the others hold what their stage last computed).
        out = np.asarray(jax.device_get(lat[0])).reshape(batch, rows * cols, -1)
        seconds = time.perf_counter() - start
        out = latent_ops.unpack(out, h, w)
        images = self.decode(out) if output_type == "np" else None
        return GenerationOutput(images=images, latents=out, seconds=seconds)


def _progress(iterable, enabled: bool, total: int):
    from jaxdit.pipelines.denoiser import progress_bar

    return progress_bar(iterable, enabled, total)


def tiny_digits(
    parallel: ParallelConfig | Mesh, folder: str | Path | None = None, **options: Any
) -> PipeFusionFluxPipeline:
    """The bundled ``tiny-digits`` model with PipeFusion (see ``jaxdit.pipelines.flux.tiny_digits``)."""
    from jaxdit.mesh import mesh_for
    from jaxdit.pipelines import tiny_digits as tiny

    mesh = mesh_for(parallel)
    folder = folder or tiny.asset_dir()
    model = PipeFusionFlux.load(folder, mesh, jnp.float32)
    labels = tiny.LabelEncoder.load(folder)

    def encode(prompts):
        ids = [label for p in prompts for label in tiny.parse_prompt(p)]
        return labels(ids)

    return PipeFusionFluxPipeline(
        model,
        scheduler=euler.FlowMatchEulerConfig(shift=1.0),
        encode=encode,
        decode=lambda z: z[:, 0],
        latent_channels=tiny.LATENT_CHANNELS,
        vae_scale_factor=1,
        **options,
    )
