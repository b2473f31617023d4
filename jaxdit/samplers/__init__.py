"""Samplers: one algorithm per module, each a host-side ``set_timesteps`` plus a pure, jit-able ``step``.

- ``flow_match_euler``: flow-matching Euler with FLUX dynamic shifting (FLUX.1).
- ``unipc``: UniPC multistep predictor-corrector on flow sigmas (Wan 2.1).

Both modules name their functions ``set_timesteps`` / ``step``; call them through the module, e.g.
``unipc.step(schedule, state, x, v)``.
"""

from jaxdit.samplers import flow_match_euler, unipc
from jaxdit.samplers.flow_match_euler import (
    FlowMatchEulerConfig,
    FlowMatchEulerSchedule,
    flux_mu,
    flux_sigmas,
)
from jaxdit.samplers.unipc import UniPCConfig, UniPCSchedule, UniPCState

__all__ = [
    "FlowMatchEulerConfig",
    "FlowMatchEulerSchedule",
    "UniPCConfig",
    "UniPCSchedule",
    "UniPCState",
    "flow_match_euler",
    "flux_mu",
    "flux_sigmas",
    "unipc",
]
