"""Feature caches under PipeFusion: the host-planned ones (MagCache, TaylorSeer alone), and why the others
are refused.

Which caches. A cache that decides from the data (First-Block-Cache, DBCache: the residual of the first
Fn blocks; TeaCache on FLUX: block 0's modulated input) needs that quantity over the WHOLE latent before
it may skip the rest of the step, but PipeFusion's first stage hands each patch on as soon as its blocks
are done: the decision would wait for every patch to clear the first blocks (a full pipeline bubble
every step). MagCache's rule reads only the stored magnitude ratios and TaylorSeer alone follows a fixed
schedule, so the host plans the whole skip pattern before the loop (:class:`Plan`) and every device
follows it; nothing waits.

What a skipped step computes (per patch, on the device where the patch's step ends): the patch is
embedded, carried through the stacks' ``enter`` transitions without running a block, the residual of
ALL blocks stored at that patch's last full step is added (MagCache; TaylorSeer: its Taylor forecast
from the last full steps, ``jaxdit.cache.taylor``), then the head, guidance and one sampler step. No
block runs on any stage, so a skipped step holds no collective of the blocks (no hop between stages, no
Ulysses all-to-all; only cfg's exchange of the patch's prediction when cfg = 2).

Stale K/V. A skipped step writes no K/V: the buffers stay as the last full step left them, so the next
full step attends to the other patches' K/V one more step old (two after two skips, ...) than PipeFusion
without a cache would. Within a full step the order is PipeFusion's own: patches before ``m`` at this
step, patches after it at their last full step.

Where the skipped steps run (``programs.py``). The pipelined loop runs over the FULL steps only;
right after a patch's full step ends (head, CFG, sampler step on the stage where its last pass ends), the
same tick applies the skipped steps that follow it in the plan to that patch (a loop whose trip count,
read from the plan, is the same on every device, so the cfg exchange inside stays matched). The patch
then re-enters stage 0 for its next full step as before. The skipped steps right after the warm-up are
applied in the last warm-up step's program the same way, patch by patch. So there is one warm-up program
and one pipelined program per step count, the plan (which steps, how many, how many skips after each,
TaylorSeer's distances) travels as data, and the pipeline never drains for a skip. The pipelined loop's
trip count is therefore data too (ticks of the plan's full steps; a ``while`` whose trip count XLA does
not know, where uncached PipeFusion's scan has a fixed one): any threshold runs the same program, which
is what lets ``jaxdit serve`` take a threshold per request on a PipeFusion mesh. Taking skipped steps
outside the loop instead would split the pipelined phase at every skip: a fill-and-drain bubble per run
of full steps and one program per run length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["PIPEFUSION_CACHES", "Plan", "refusal"]

#: The caches that run under PipeFusion (host-planned).
PIPEFUSION_CACHES = ("magcache", "taylorseer")

_RUNS = (
    "the caches that run with PipeFusion are --cache magcache and --cache taylorseer (planned on the host)"
)
_REASONS = {
    "fbcache": "First-Block-Cache decides each step from block 0's residual over the WHOLE latent",
    "dbcache": "DBCache decides each step from the residual of its first Fn blocks over the WHOLE latent",
    "teacache": "TeaCache decides each step from the change of block 0's input over the WHOLE latent",
    "magcache-calibration": "the MagCache calibration measures each step's residual over the WHOLE latent",
    "teacache-calibration": "the TeaCache calibration measures each step's change over the WHOLE latent",
}


def refusal(
    name: str, family_caches: Any = PIPEFUSION_CACHES, display: str = "this model", have: Sequence[str] = ()
) -> str | None:
    """Why cache ``name`` cannot run with PipeFusion (None: it can). ``family_caches``: the caches the
    family's PipeFusion runner takes; ``have``: the models whose runners take it (the caller's registry)."""
    if name in PIPEFUSION_CACHES and name in family_caches:
        return None
    if name in PIPEFUSION_CACHES:
        others = f" ({', '.join(have)} have it)" if have else ""
        return f"{name} does not run with PipeFusion on {display} yet{others}"
    reason = _REASONS.get(name, f"{name} decides from the data")
    return (
        f"{reason}, which PipeFusion's first stage never holds at once (it hands each patch on as soon as "
        f"its blocks are done; the decision would wait for every patch, a full pipeline bubble per step): "
        f"{_RUNS}; or run {name} on ulysses/ring/cfg/tensor/data"
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """A host-planned cache's steps under PipeFusion (all int32 [steps] unless said).

    ``ran`` bool: the steps that run every block (the warm-up steps are forced full); ``follow``: at a
    full step, how many skipped steps follow it (0 elsewhere); ``distance``: steps since the previous
    full step (TaylorSeer's finite differences; at a skipped step, since its last full step);
    ``full_before``: full steps before this one; ``full_index`` [F]: the pipelined full steps (after
    the warm-up), in order.
    """

    ran: np.ndarray
    follow: np.ndarray
    distance: np.ndarray
    full_before: np.ndarray
    full_index: np.ndarray

    @classmethod
    def build(cls, policy: Any, steps: int, warmup_steps: int, segments: Sequence[Any] = ()) -> Plan:
        """The plan of ``policy`` over ``steps`` steps whose synchronous steps are the first
        ``warmup_steps`` or, with ``segments`` (``segments.Segment``, Wan 2.2 A14B's experts), each
        segment's warm-up: those are forced full, so a run of skipped steps never crosses an expert switch
        (the next expert's residual starts from its own warm-up step)."""
        synchronous = (
            [s.first + k for s in segments for k in range(s.warmup)] if segments else range(warmup_steps)
        )
        forced = policy.forced(steps, synchronous)
        ran = np.asarray(policy.host_pattern(steps, forced), bool)
        follow = np.zeros(steps, np.int32)
        distance = np.zeros(steps, np.int32)
        full_before = np.zeros(steps, np.int32)
        last, count = 0, 0
        for i in range(steps):
            distance[i] = i - last
            full_before[i] = count
            if ran[i]:
                last, count = i, count + 1
            else:
                follow[last] += 1
        full_index = np.setdiff1d(np.flatnonzero(ran), synchronous).astype(np.int32)
        return cls(ran, follow, distance, full_before, full_index)

    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(follow, distance, full_before): what the programs read."""
        return self.follow, self.distance, self.full_before

    def pipelined(self, first: int = 0, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(the pipelined full steps in ``first .. end - 1`` -- one expert segment's; all by default --
        padded to one entry per step, the count of its real entries): what the pipelined program reads
        besides :meth:`tables`. The padding repeats the last full step (never read: the schedule's items
        past the count are not valid), so every plan and segment of the run's step count has the same
        shapes and runs the same program."""
        end = len(self.ran) if end is None else end
        index = self.full_index[(self.full_index >= first) & (self.full_index < end)]
        padded = np.full(len(self.ran), index[-1] if len(index) else 0, np.int32)
        padded[: len(index)] = index
        return padded, np.int32(len(index))
