"""Wan 2.2 A14B's two experts: which one denoises each step, and where the idle one waits.

Wan 2.2's A14B models (T2V and I2V) are two transformers of Wan2.1-14B's shape, a mixture of experts
split by noise level: the high-noise expert runs while the step's timestep t >= boundary x
num_train_timesteps (boundary 0.875 for T2V, 0.900 for I2V), the low-noise expert after, each with its
own guidance scale (diffusers ``pipelines/wan/pipeline_wan.py``: ``transformer`` / ``guidance_scale`` and
``transformer_2`` / ``guidance_scale_2``; Wan-Video/Wan2.2 ``wan/text2video.py``).

Both experts have the same config, so the same shapes and shardings: the denoising step is compiled
ONCE and each step is handed the parameters of its expert (``Denoiser.run`` takes a per-step choice).
Where the two parameter sets live is a choice (:class:`TwoExperts`):

- resident (default): both on the mesh, each sharded by the rule table exactly as one model is
  (replicated, or split over ``tensor``). 2 x 14B bf16 = 57 GB per device without tensor parallelism,
  28.6 GB with tensor=2. The switch costs nothing.
- ``offload_idle_expert``: only the running expert on the mesh; the idle one waits in host memory
  (``pinned_host``, each device's own shard, so nothing is gathered and it works across hosts). At the
  switch the running expert is copied out and its device buffers freed before the other is copied in,
  so device memory never holds both: half the parameter memory, for one host -> device copy of one
  expert's shard per device per switch (two per generation: the high-noise expert comes back at the
  next generation's first step). On a PCIe 5 host (~50 GB/s) 28.6 GB takes ~0.6 s, against a
  generation of minutes.

Sharding the two experts over different devices (one expert per half of the mesh) would leave half the
devices idle at every step. Under PipeFusion (pipefusion > 1) each expert is laid out in the same stage
slots (``PipeFusionWan``: 1/P of its blocks per device) and the same switch applies; the runner runs each
expert's run of steps as a PipeFusion run of its own (``pipefusion/segments.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

__all__ = [
    "HIGH_NOISE",
    "LOW_NOISE",
    "ParameterHolder",
    "TwoExperts",
    "expert_of_steps",
    "guidance_of_steps",
    "to_host",
]

#: Expert indices: the first (diffusers' ``transformer``) and the second (``transformer_2``).
HIGH_NOISE, LOW_NOISE = 0, 1


def expert_of_steps(
    timesteps: Sequence[float], boundary_ratio: float, num_train_timesteps: int
) -> tuple[int, ...]:
    """The expert each step runs: high-noise while t >= boundary_ratio x num_train_timesteps, as diffusers
    compares its scheduler's (integer) timesteps with the float boundary."""
    if not 0.0 < boundary_ratio < 1.0:
        raise ValueError(f"boundary_ratio must lie in (0, 1), got {boundary_ratio}")
    boundary = boundary_ratio * num_train_timesteps
    return tuple(HIGH_NOISE if float(t) >= boundary else LOW_NOISE for t in np.asarray(timesteps))


def guidance_of_steps(
    experts: Sequence[int], guidance_scale: float, guidance_scale_2: float
) -> tuple[float, ...]:
    """Each step's classifier-free guidance scale: its expert's."""
    return tuple(float(guidance_scale if e == HIGH_NOISE else guidance_scale_2) for e in experts)


def to_host(state: Any) -> Any:
    """Parameters on the mesh -> the same shards in each device's host memory (``pinned_host``), the device
    buffers freed at once (so that the other expert can come in without the two ever sharing the devices).
    Parameters already in host memory are returned as they are."""
    leaves = jax.tree.leaves(state)
    if all(leaf.sharding.memory_kind == "pinned_host" for leaf in leaves):
        return state
    host = jax.device_put(state, jax.tree.map(lambda a: a.sharding.with_memory_kind("pinned_host"), state))
    jax.block_until_ready(host)
    for leaf in leaves:
        leaf.delete()
    return host


def _same_layout(first: Any, second: Any) -> str | None:
    """Why two parameter trees cannot share one compiled step (None if they can)."""
    if jax.tree.structure(first) != jax.tree.structure(second):
        return "their parameter trees differ"
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            return f"a parameter is {a.shape} {a.dtype} in one and {b.shape} {b.dtype} in the other"
    return None


class ParameterHolder(Protocol):
    """What holds a model's parameters on the mesh: a ``ShardedForward`` (the plain loop) or a PipeFusion
    stage layout (``pipefusion.stages.StagedModel``). Its ``state`` is what it computes with."""

    state: Any
    param_shardings: Any


class TwoExperts:
    """The two experts' parameters for one :class:`ParameterHolder`, resident or with the idle one offloaded.

    ``holder.state`` is the high-noise expert's parameters (the holder was built from it);
    ``low_noise`` the low-noise expert's, on the mesh with the same shardings (``holder.param_shardings``)
    or already in host memory (a pipeline that offloads loads it first and moves it out before the other
    is read, so the two are never on the devices together). ``params(expert)`` returns the
    chosen expert's parameters on the mesh; with ``offload_idle_expert`` it first swaps the two (the
    running one to host memory, its device buffers freed; the other in), and keeps ``holder.state`` the
    resident one, so the forward (or the PipeFusion runner) called on its own computes with whichever
    expert is on the mesh.
    """

    def __init__(self, holder: ParameterHolder, low_noise: Any, *, offload_idle_expert: bool = False) -> None:
        why = _same_layout(holder.state, low_noise)
        if why is not None:
            raise ValueError(f"the two Wan experts must have one architecture, but {why}")
        self.holder = holder
        self.offload = offload_idle_expert
        self.device_shardings = holder.param_shardings
        # Placed already (device_put is then a no-op), or offloaded at once.
        placed = to_host(low_noise) if self.offload else jax.device_put(low_noise, self.device_shardings)
        self.states = [holder.state, placed]
        self.resident = HIGH_NOISE

    def params(self, expert: int) -> Any:
        """The parameters of ``expert`` (:data:`HIGH_NOISE` / :data:`LOW_NOISE`), on the mesh."""
        if expert not in (HIGH_NOISE, LOW_NOISE):
            raise ValueError(
                f"expert must be {HIGH_NOISE} (high noise) or {LOW_NOISE} (low noise), got {expert}"
            )
        if not self.offload:
            return self.states[expert]
        if expert != self.resident:
            idle = self.resident
            self.states[idle] = to_host(self.states[idle])
            self.states[expert] = jax.device_put(self.states[expert], self.device_shardings)
            self.resident = expert
            self.holder.state = self.states[expert]
        return self.states[expert]

    def memory_kinds(self) -> tuple[str, str]:
        """Where each expert's parameters are now ("device" or "pinned_host"), high-noise first."""
        return tuple(jax.tree.leaves(s)[0].sharding.memory_kind for s in self.states)  # type: ignore[return-value]
