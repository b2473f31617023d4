"""PipeFusion over a schedule whose steps run different parameter sets (Wan 2.2 A14B's two experts).

PipeFusion's pipelined steps attend to the other patches' K/V from the previous step (stale K/V). Two
experts are two models: K/V computed by the high-noise expert says nothing about the low-noise one's
layers, so the pipelined phase must never read the other expert's buffers. The schedule is therefore cut
into expert segments -- runs of consecutive steps with one expert (high noise first, then low noise, as
``wan_experts.expert_of_steps`` gives them) -- and each segment is a PipeFusion run of its own: its
warm-up step(s), synchronous steps on the whole sequence with that expert's parameters that refill every
layer's K/V buffer, then one pipelined call over the rest of the segment. The latents and the sampler
state carry over from one segment to the next (the sampler's multistep history belongs to the
trajectory, not to an expert, as in the plain loop).

Cost: a switch adds the next segment's warm-up steps to the synchronous ones (one extra synchronous
step per switch with the default ``warmup_steps=1``: for Wan 2.2 A14B, one of 40 or 50 steps), and one
more launch of a pipelined program (compiled per (length, first step)). A segment shorter than the
warm-up runs all its steps synchronously.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Segment", "expert_segments"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Steps ``first`` .. ``first + steps - 1``, all run by ``expert`` (None: the model's one parameter
    set): the first ``warmup`` of them synchronous, the rest pipelined."""

    expert: int | None
    first: int
    steps: int
    warmup: int

    @property
    def pipelined(self) -> int:
        return self.steps - self.warmup


def expert_segments(experts: Sequence[int], steps: int, warmup_steps: int) -> tuple[Segment, ...]:
    """The segments of a schedule of ``steps`` steps whose step i runs ``experts[i]`` (empty: one
    parameter set throughout), each starting with ``min(warmup_steps, its length)`` warm-up steps.

    Raises ValueError (naming the numbers) when ``experts`` does not give one expert per step.
    """
    if not experts:
        return (Segment(None, 0, steps, min(warmup_steps, steps)),)
    if len(experts) != steps:
        raise ValueError(f"{len(experts)} experts for {steps} steps: PipeFusion needs one per step")
    segments, first = [], 0
    for i in range(1, steps + 1):
        if i == steps or experts[i] != experts[first]:
            length = i - first
            segments.append(Segment(int(experts[first]), first, length, min(warmup_steps, length)))
            first = i
    return tuple(segments)
