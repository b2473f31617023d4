"""Samplers: one algorithm per module, each a host-side ``set_timesteps`` plus a pure, jit-able ``step``.

- ``flow_match_euler``: flow-matching Euler with FLUX dynamic shifting (FLUX.1).
- ``unipc``: UniPC multistep predictor-corrector on flow sigmas (Wan 2.1).

Both modules name their functions ``set_timesteps`` / ``step``; call them through the module, e.g.
``unipc.step(schedule, state, x, v)``. ``sampler`` binds each to the protocol the denoising loops use
(:class:`Sampler`: schedule, init_state, model_time, step with an explicit step index).
"""

from jaxdit.samplers import flow_match_euler, unipc
from jaxdit.samplers.flow_match_euler import (
    FlowMatchEulerConfig,
    FlowMatchEulerSchedule,
    dynamic_shift_mu,
    linear_sigmas,
)
from jaxdit.samplers.sampler import EulerSampler, Sampler, UniPCSampler
from jaxdit.samplers.unipc import UniPCConfig, UniPCSchedule, UniPCState

__all__ = [
    "EulerSampler",
    "FlowMatchEulerConfig",
    "FlowMatchEulerSchedule",
    "Sampler",
    "UniPCConfig",
    "UniPCSampler",
    "UniPCSchedule",
    "UniPCState",
    "flow_match_euler",
    "dynamic_shift_mu",
    "linear_sigmas",
    "unipc",
]
