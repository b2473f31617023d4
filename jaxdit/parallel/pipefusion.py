"""PipeFusion (Fang et al., arXiv 2405.14430): patch-pipelined denoising over layer stages with stale K/V.

The stacked transformer blocks are split over the ``pipefusion`` mesh axis into P stages (each device
holds 1/P of them) and the latent into M >= P patches. A patch's tokens go through the stages one after
the other, so the stages work on different patches at the same time. Attention in a layer needs every
token's K/V: it takes the fresh K/V of the patches that layer has already computed in this step and the
previous step's (stale) K/V for the rest, kept in a per-layer buffer on the device that owns the layer.
Neighbouring diffusion steps have nearly the same activations, so the error is small; the first
``warmup_steps`` steps run synchronously (the full sequence through the stages) to fill the buffers.
Only patch activations (and, if the last stage is not the first, latent patches) cross devices;
K/V never does.

This module holds what does not depend on the model and everything that names a mesh axis
(``jaxdit.pipelines.pipefusion`` runs a model family's staged forward on it: parameters in stage slots,
the warm-up step and the pipelined phase, one runner for every family):

- :class:`PipeSchedule`, the static timetable of the asynchronous phase as a ``lax.scan`` over ticks.
  A model may make V passes over the stages (FLUX: double blocks, then single blocks, each stack split
  over all P devices so that every device holds 1/P of both). Passes alternate direction (a V shape):
  pass 0 runs up the stages, pass 1 back down, so the hand-over between passes stays on one device and,
  for even V, the last pass ends on stage 0, where the next step of that patch starts: the updated latent
  patch never moves. A patch visits V x P "virtual stages", one per tick; at every tick each device runs
  each of its V passes once, on whichever patches are there. The loop from a patch's entry to its next
  step's entry is V x P ticks, so M >= V x P patches keep the pipeline full; P <= M < V x P works with
  V x P - M idle ticks per step. Bubbles are only at the two ends of the scan.
- :func:`stage_layer_order`, which layer of a stack each device's slots hold (V-shaped, padded to
  ceil(L / P) slots per device: padded slots hold zero weights).
- :func:`shift`, the PipeFusion collective: a ``ppermute`` of one patch's activations to the
  neighbouring stage; :func:`to_first_stage`, the updated latent patch's way back when a model's last
  pass ends on the last stage (odd V); :func:`guide_patch`, CFG on one patch's prediction (with cfg=2,
  one permute of it to the other branch's device).
- :func:`patch_attention` and :class:`PatchContext`: attention of a patch (or the full sequence, in
  warm-up) against fresh K/V, merged by log-sum-exp with the stale buffer: Ulysses and Ring inside a
  stage, the ring being ``parallel/ring.py``'s, which keeps the K/V blocks that pass; they are the fresh
  K/V of every sequence shard, returned for the buffer.
- :func:`write_patch`: the buffer update of one patch's slot, only where the tick's work is real.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdit.parallel.cfg import CFG_AXIS
from jaxdit.parallel.cfg import guidance as cfg_guidance
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.local_attention import local_attention, merge_partials
from jaxdit.parallel.ring import RING_AXIS, ring_attention
from jaxdit.parallel.ulysses import ULYSSES_AXIS, heads_to_seq, seq_to_heads

PIPE_AXIS = "pipefusion"

__all__ = [
    "PIPE_AXIS",
    "PatchContext",
    "PipeSchedule",
    "guide_patch",
    "patch_attention",
    "shift",
    "stage_index",
    "stage_layer_order",
    "to_first_stage",
    "validate_pipefusion",
    "write_patch",
]


# --------------------------------------------------------------------------------------------------------
# Validation and schedule
# --------------------------------------------------------------------------------------------------------


def validate_pipefusion(stages: int, patches: int, warmup_steps: int, steps: int) -> None:
    """Raise ValueError for a PipeFusion configuration that cannot run; the message names the numbers."""
    if patches < stages:
        raise ValueError(
            f"num_pipeline_patch={patches} is smaller than pipefusion_parallel_degree={stages}: every "
            f"stage needs a patch of its own in flight (use at least {stages} patches)"
        )
    if warmup_steps < 1:
        raise ValueError(
            f"warmup_steps={warmup_steps}: PipeFusion needs at least one synchronous step, which fills every "
            "layer's K/V buffer that the asynchronous steps read as the previous step's K/V"
        )
    if warmup_steps > steps:
        raise ValueError(f"warmup_steps={warmup_steps} exceeds the {steps} denoising steps")


@dataclasses.dataclass(frozen=True)
class PipeSchedule:
    """The asynchronous phase's timetable: ``steps`` steps of ``patches`` patches through ``passes``
    passes over ``stages`` stages.

    Work item g = step * M + patch enters virtual stage 0 at tick ``step * period + patch`` and reaches
    virtual stage j at tick ``entry + j``. Virtual stage j is pass ``j // P`` on device ``j % P`` for even
    passes and ``P - 1 - j % P`` for odd ones (V shape). Everything is static except the tick.
    """

    stages: int
    patches: int
    passes: int
    steps: int

    def __post_init__(self) -> None:
        if self.stages < 1 or self.passes < 1 or self.steps < 0:
            raise ValueError(f"bad schedule: {self}")
        if self.patches < self.stages:
            validate_pipefusion(self.stages, self.patches, 1, 1)

    @property
    def depth(self) -> int:
        """Virtual stages a patch goes through per step (passes x stages)."""
        return self.passes * self.stages

    @property
    def period(self) -> int:
        """Ticks between a patch's entries in consecutive steps: the patch must have left the last
        virtual stage (``depth`` ticks) before its next step starts."""
        return max(self.patches, self.depth)

    @property
    def ticks(self) -> int:
        """Length of the scan: the last item enters at ``(steps-1)*period + M-1`` and needs ``depth``."""
        if self.steps == 0:
            return 0
        return (self.steps - 1) * self.period + self.patches - 1 + self.depth

    @property
    def last_stage(self) -> int:
        """The device of a patch's last virtual stage, where its step ends (stage 0 for even V, else P-1)."""
        return self.position(self.passes - 1, self.stages - 1)

    @property
    def utilization(self) -> float:
        """Share of (tick, virtual stage) slots doing real work; the rest are bubbles."""
        return self.steps * self.patches / self.ticks if self.ticks else 1.0

    def position(self, pass_index: int, stage: jax.Array | int) -> jax.Array | int:
        """The position of ``stage`` along pass ``pass_index`` (0 = the pass's first device), and the
        device at a position (the map is its own inverse)."""
        return stage if pass_index % 2 == 0 else self.stages - 1 - stage

    def item(
        self, tick: jax.Array, pass_index: int, stage: jax.Array, steps: jax.Array | None = None
    ) -> tuple[jax.Array, ...]:
        """(valid, step, patch) of the work pass ``pass_index`` does on ``stage`` at ``tick`` (traced).
        ``steps``: a traced step count at most ``self.steps`` (a host-planned cache's full steps, data
        of one program: :meth:`ticks_of`)."""
        steps = self.steps if steps is None else steps
        virtual = pass_index * self.stages + self.position(pass_index, stage)
        entry = tick - virtual
        step, patch = entry // self.period, entry % self.period
        valid = (entry >= 0) & (patch < self.patches) & (step < steps)
        return valid, jnp.clip(step, 0, steps - 1), jnp.clip(patch, 0, self.patches - 1)

    def ticks_of(self, steps: jax.Array) -> jax.Array:
        """:attr:`ticks` for a traced step count of at least 1."""
        return (steps - 1) * self.period + self.patches - 1 + self.depth


def stage_layer_order(num_layers: int, stages: int, pass_index: int) -> np.ndarray:
    """Slot -> layer index (-1: padding) for a stack of ``num_layers`` split over ``stages`` devices.

    Device s holds slots ``[s * k, (s + 1) * k)`` with k = ceil(L / P) (the stacked axis is split evenly
    over ``pipefusion`` by the sharding rules). Pass ``pass_index`` visits the devices in V order, so the
    c-th contiguous chunk of layers lives on the device at position c of the pass. Chunks differ by at
    most one layer; the first ``L % P`` chunks are the longer ones and the rest end with a padded slot.
    """
    if num_layers < 1:
        raise ValueError(f"a PipeFusion stage needs layers to split, got {num_layers}")
    k = -(-num_layers // stages)
    base, extra = divmod(num_layers, stages)
    order = np.full((stages, k), -1, np.int64)
    start = 0
    for c in range(stages):
        n = base + (c < extra)
        device = c if pass_index % 2 == 0 else stages - 1 - c
        order[device, :n] = np.arange(start, start + n)
        start += n
    return order.reshape(-1)


# --------------------------------------------------------------------------------------------------------
# Communication: one patch to the neighbouring stage
# --------------------------------------------------------------------------------------------------------


def shift(x: jax.Array, direction: int, stages: int) -> jax.Array:
    """Send ``x`` one stage up (``direction=+1``) or down (-1) the pipefusion axis; the device at the
    end receives zeros and the one at the start sends nothing. Inside ``shard_map``."""
    if stages == 1:
        return jnp.zeros_like(x)
    if direction == 1:
        pairs = [(s, s + 1) for s in range(stages - 1)]
    else:
        pairs = [(s + 1, s) for s in range(stages - 1)]
    return lax.ppermute(x, PIPE_AXIS, pairs)


def to_first_stage(x: jax.Array, stages: int) -> jax.Array:
    """The last stage's ``x`` on stage 0 (the others receive zeros). Inside ``shard_map``."""
    return x if stages == 1 else lax.ppermute(x, PIPE_AXIS, [(stages - 1, 0)])


def stage_index() -> jax.Array:
    """This device's stage (traced). Inside ``shard_map``."""
    return lax.axis_index(PIPE_AXIS)


def guide_patch(pred: jax.Array, scale: jax.Array, cfg: int, rule: Any = cfg_guidance) -> jax.Array:
    """Classifier-free guidance of one patch's prediction, laid out [uncond; cond] by
    ``interleave_branches``: over the local branches (cfg=1) or with the other cfg device's branch
    (cfg=2: one permute of this patch's prediction). ``rule(uncond, cond, scale)``: the family's
    combination (default: plain CFG), per token. Inside ``shard_map``."""
    if cfg == 1:
        uncond, cond = jnp.split(pred, 2, axis=0)
        return rule(uncond, cond, scale)
    other = lax.ppermute(pred, CFG_AXIS, [(0, 1), (1, 0)])
    is_cond = lax.axis_index(CFG_AXIS) == 1
    return rule(jnp.where(is_cond, other, pred), jnp.where(is_cond, pred, other), scale)


# --------------------------------------------------------------------------------------------------------
# Attention with fresh and stale K/V
# --------------------------------------------------------------------------------------------------------


def patch_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    ring: int,
    ulysses: int,
    fresh_valid: jax.Array | None,
    stale: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    kernel: Sequence[tuple[str, Any]] = (),
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of this device's fresh tokens over (fresh K/V of every sequence shard) + (stale buffer).

    q/k/v [B, n, H, D]: this device's tokens (one patch's piece, or all pieces in warm-up), sequence-
    sharded over (ring, ulysses). Ulysses' all_to_all gathers the U pieces of a ring position and splits
    heads; :func:`ring_attention` passes those K/V blocks round the R positions (R - 1 hops), as in USP,
    and keeps every block that passes: together they are the fresh K/V of the whole patch,
    [B, R*U*n, H/U, D] ordered by sequence shard, which is what the caller stores (xDiT keeps
    post-all-to-all K/V the same way, so a stage's buffer holds every token for its heads and stale
    attention needs no communication).

    ``fresh_valid`` [R, U*n] marks the real keys of each ring position's block (None: all real).
    ``stale`` = (k_buf, v_buf, valid): the buffer [B, Lb, H/U, D] and [Lb] bool, False for padding and for
    the slots the fresh K/V replaces. Partial results merge by log-sum-exp in fp32, so the output equals
    attention over the union of the fresh and the valid stale keys.

    Returns (output [B, n, H, D] in q's dtype, fresh k, fresh v).
    """
    kw = dict(kernel)
    qh, kh, vh = (seq_to_heads(t, ulysses, ULYSSES_AXIS) for t in (q, k, v))
    batch = qh.shape[0]

    def mask(valid: jax.Array | None) -> jax.Array | None:
        return None if valid is None else jnp.broadcast_to(valid, (batch, valid.shape[-1]))

    key_valid_for = None if fresh_valid is None else (lambda source: mask(fresh_valid[source]))
    out, lse, (k_all, v_all) = ring_attention(
        qh, kh, vh, ring, key_valid_for, RING_AXIS, out_dtype=jnp.float32, keep_blocks=True, **kw
    )
    if stale is not None:
        k_buf, v_buf, stale_valid = stale
        o, l = local_attention(qh, k_buf, v_buf, mask(stale_valid), out_dtype=jnp.float32, **kw)
        out, lse = merge_partials(out, lse, o, l)
    return heads_to_seq(out.astype(q.dtype), ulysses, ULYSSES_AXIS), k_all, v_all


@dataclasses.dataclass(frozen=True)
class PatchContext(ShardContext):
    """The :class:`ShardContext` a model's blocks see inside a PipeFusion stage.

    ``ctx.attention`` is :func:`patch_attention` against this layer's stale buffer; the fresh K/V it
    gathers is appended to ``fresh`` (one (k, v) pair per attention call) for the caller to store. Model
    code is unchanged: it calls ``ctx.attention`` and ``ctx.sum_tensor_parallel`` as always, and
    ``ctx.layout`` joins/splits its token groups locally.
    """

    fresh_valid: jax.Array | None = None
    stale: tuple[jax.Array, jax.Array, jax.Array] | None = None
    fresh: list = dataclasses.field(default_factory=list)

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        out, k_all, v_all = patch_attention(
            q,
            k,
            v,
            ring=self.config.ring,
            ulysses=self.config.ulysses,
            fresh_valid=self.fresh_valid,
            stale=self.stale,
            kernel=self.kernel,
        )
        self.fresh.append((k_all, v_all))
        return out

    def group_attention(self, group: int):
        """Attention over one token group alone, against fresh and stale K/V: the group's q/k/v are put
        in the patch's full token layout (zeros for the other groups), the other groups' keys are masked
        in the fresh block and in the buffer, and the group's tokens come back. Exact: a masked key adds
        nothing. The stored K/V keep the full layout (the same buffer shape for every stack)."""
        layout = self.layout
        own = np.concatenate([np.full(n, i == group) for i, n in enumerate(layout.local_lengths)])
        fresh_keys = np.tile(own, self.config.ulysses)  # a ring position's block: U shards' local tokens
        fresh = jnp.asarray(fresh_keys) if self.fresh_valid is None else self.fresh_valid & fresh_keys
        fresh = jnp.broadcast_to(fresh, (self.config.ring, *fresh.shape[-1:])) if fresh.ndim == 1 else fresh
        stale = self.stale
        if stale is not None:
            k_buf, v_buf, valid = stale
            stale = (k_buf, v_buf, valid & np.tile(own, valid.shape[-1] // own.size))
        inner = dataclasses.replace(self, fresh_valid=fresh, stale=stale)  # shares ``fresh``'s list

        def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            def full(x):
                parts = [
                    x if i == group else jnp.zeros((x.shape[0], n, *x.shape[2:]), x.dtype)
                    for i, n in enumerate(layout.local_lengths)
                ]
                return layout.join_local(parts)

            return layout.split_local(inner.attention(full(q), full(k), full(v)))[group]

        return attend


def write_patch(buffer: jax.Array, fresh: jax.Array, patch: jax.Array, valid: jax.Array) -> jax.Array:
    """Store one patch's fresh K (or V) of every slot: buffer [slots, B, M, L, h, D], fresh [slots, B, L,
    h, D]; the slot's old value is kept where ``valid`` is False (a bubble tick computes nothing real)."""
    index = (0, 0, patch, 0, 0, 0)
    old = lax.dynamic_slice(buffer, index, (buffer.shape[0], buffer.shape[1], 1, *buffer.shape[3:]))
    new = jnp.where(valid, fresh[:, :, None].astype(buffer.dtype), old)
    return lax.dynamic_update_slice(buffer, new, index)
