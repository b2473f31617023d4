"""Flow-matching Euler sampler (FLUX.1).

The flow convention is ``x_sigma = (1 - sigma) * x0 + sigma * noise`` and the model predicts the velocity
``v = noise - x0`` (rectified flow / flow matching: Liu et al., arXiv 2209.03003; Lipman et al., arXiv
2210.02747). Sampling integrates ``dx/dsigma = v`` with explicit Euler steps from sigma = 1 down to a
terminal sigma = 0. The schedule is shifted towards high noise, either by a fixed ``shift`` (SD3, Esser et
al., arXiv 2403.03206) or by FLUX's resolution-dependent ``mu`` ("dynamic shifting").

Follows diffusers' ``FlowMatchEulerDiscreteScheduler`` (schedulers/scheduling_flow_match_euler_discrete.py,
diffusers 0.42.1) and ``calculate_shift`` in pipelines/flux/pipeline_flux.py, as a functional contract:
``set_timesteps`` runs on the host in numpy and returns arrays, ``step`` is a pure function of arrays and
runs under ``jax.jit`` / ``lax.scan``. Only the default "exponential" time shift is supported, optionally
stretched to end at ``shift_terminal`` (Qwen-Image); karras / exponential / beta sigmas,
``invert_sigmas`` and stochastic sampling are not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FlowMatchEulerConfig",
    "FlowMatchEulerSchedule",
    "dynamic_shift_mu",
    "linear_sigmas",
    "set_timesteps",
    "stretch_to_terminal",
    "step",
]


@dataclasses.dataclass(frozen=True)
class FlowMatchEulerConfig:
    """Static configuration; field names and defaults are those of diffusers' scheduler config."""

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    #: The last sigma the shifted schedule is stretched to end at (None / 0: no stretch).
    shift_terminal: float | None = None

    def __post_init__(self) -> None:
        if self.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be >= 1, got {self.num_train_timesteps}")
        if not self.shift > 0:
            raise ValueError(f"shift must be > 0, got {self.shift}")
        if self.base_image_seq_len == self.max_image_seq_len:
            raise ValueError(
                f"base_image_seq_len and max_image_seq_len must differ (the mu line needs two points), "
                f"got {self.base_image_seq_len} for both"
            )
        if self.shift_terminal is not None and not 0 <= self.shift_terminal < 1:
            raise ValueError(f"shift_terminal must be in [0, 1), got {self.shift_terminal}")

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any]) -> FlowMatchEulerConfig:
        """Builds the config from a diffusers ``scheduler_config.json`` (or ``scheduler.config``).

        Raises ``ValueError`` for options this sampler does not implement, rather than ignoring them.
        """
        for key in (
            "invert_sigmas",
            "use_karras_sigmas",
            "use_exponential_sigmas",
            "use_beta_sigmas",
            "stochastic_sampling",
        ):
            if config.get(key):
                raise ValueError(f"scheduler option {key}={config[key]!r} is not supported")
        if config.get("time_shift_type", "exponential") != "exponential":
            raise ValueError(
                f"time_shift_type={config['time_shift_type']!r} is not supported (only 'exponential')"
            )
        kwargs = {}
        for field in dataclasses.fields(cls):
            # Some configs store None for fields that only matter with dynamic shifting; keep our default.
            if config.get(field.name) is not None:
                kwargs[field.name] = config[field.name]
        return cls(**kwargs)


class FlowMatchEulerSchedule(NamedTuple):
    """Host-side schedule for ``num_steps`` steps.

    sigmas:    float32 [num_steps + 1], decreasing, ending with a terminal 0.
    timesteps: float32 [num_steps], ``sigmas[:-1] * num_train_timesteps``.
    """

    sigmas: np.ndarray
    timesteps: np.ndarray


def dynamic_shift_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """The dynamic-shift ``mu`` of FLUX.1 and the flow-matching families after it (diffusers'
    ``calculate_shift``): linear in the image token count, base_shift at base_seq_len and max_shift at
    max_seq_len; a family passes its scheduler config's values. FLUX.1 at 1024x1024 (4096 tokens): 1.15."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    intercept = base_shift - slope * base_seq_len
    return image_seq_len * slope + intercept


def linear_sigmas(num_steps: int) -> np.ndarray:
    """The unshifted sigmas flow-matching pipelines (FLUX.1's among them) pass in: ``linspace(1, 1/N, N)``
    (float64)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return np.linspace(1.0, 1.0 / num_steps, num_steps)


def _shift(config: FlowMatchEulerConfig, sigmas: np.ndarray, mu: float | None) -> np.ndarray:
    # Written so numpy keeps the dtype of `sigmas` (Python scalars do not promote): float32 for sigmas the
    # caller passed in, float64 for the default grid, as in diffusers.
    if config.use_dynamic_shifting:
        e_mu = math.exp(mu)
        return e_mu / (e_mu + (1 / sigmas - 1))
    return config.shift * sigmas / (1 + (config.shift - 1) * sigmas)


def stretch_to_terminal(sigmas: np.ndarray, terminal: float) -> np.ndarray:
    """Scale ``1 - sigma`` so that the last sigma is ``terminal`` (LTX-Video's ``rf.py``, diffusers'
    ``stretch_shift_to_terminal``), in the dtype of ``sigmas``."""
    one_minus = 1 - sigmas
    if one_minus[-1] <= 0:
        raise ValueError(
            f"the schedule ends at sigma {float(sigmas[-1]):g}, which shift_terminal={terminal:g} cannot stretch "
            "(diffusers divides by zero there: NaN sigmas); a single step from pure noise has no stretch: "
            "use 2 or more steps"
        )
    return 1 - one_minus / (one_minus[-1] / (1 - terminal))


def set_timesteps(
    config: FlowMatchEulerConfig,
    num_steps: int | None = None,
    *,
    sigmas: Sequence[float] | np.ndarray | None = None,
    mu: float | None = None,
) -> FlowMatchEulerSchedule:
    """Computes the shifted sigma schedule and timesteps on the host.

    Args:
      config: the sampler config.
      num_steps: number of denoising steps; may be omitted when ``sigmas`` is given.
      sigmas: unshifted sigmas, one per step (the FLUX pipeline passes ``linear_sigmas(N)``). Cast to float32
        before shifting. When omitted, N points are spaced linearly between the ends of the training grid.
      mu: the dynamic-shift parameter (see ``dynamic_shift_mu``); required iff ``config.use_dynamic_shifting``.
    """
    if config.use_dynamic_shifting and mu is None:
        raise ValueError("config.use_dynamic_shifting is set, so `mu` must be given (see dynamic_shift_mu)")
    if sigmas is not None:
        sigmas = np.asarray(sigmas).astype(np.float32)
        if sigmas.ndim != 1 or sigmas.size == 0:
            raise ValueError(f"sigmas must be a non-empty 1-D sequence, got shape {sigmas.shape}")
        if num_steps is not None and num_steps != sigmas.size:
            raise ValueError(f"num_steps={num_steps} but {sigmas.size} sigmas were given")
    else:
        if num_steps is None or num_steps < 1:
            raise ValueError(f"num_steps must be >= 1 when sigmas are not given, got {num_steps}")
        # The end points are those of the float32 training grid sigma = t/T, t = T..1. Without dynamic
        # shifting that grid is already shifted, so the end point near 0 ends up shifted twice (the linspace
        # below is shifted again): diffusers does this, and we follow it to produce the same schedule.
        train = np.linspace(1, config.num_train_timesteps, config.num_train_timesteps, dtype=np.float32)
        train = train[::-1] / np.float32(config.num_train_timesteps)
        if not config.use_dynamic_shifting:
            train = _shift(config, train, None)
        t = config.num_train_timesteps
        sigmas = np.linspace(float(train[0]) * t, float(train[-1]) * t, num_steps) / t

    sigmas = _shift(config, sigmas, mu)
    if config.shift_terminal:
        sigmas = stretch_to_terminal(sigmas, config.shift_terminal)
    sigmas = sigmas.astype(np.float32)
    timesteps = sigmas * np.float32(config.num_train_timesteps)
    sigmas = np.concatenate([sigmas, np.zeros(1, np.float32)])
    return FlowMatchEulerSchedule(sigmas=sigmas, timesteps=timesteps)


def step(
    sample: jax.Array,
    model_output: jax.Array,
    sigma: jax.Array | float,
    sigma_next: jax.Array | float,
) -> jax.Array:
    """One Euler step ``x + (sigma_next - sigma) * v``, computed in float32 and cast back to the sample
    dtype. ``sigma``/``sigma_next`` may be traced (e.g. ``schedule.sigmas[i]`` inside ``lax.scan``).

    (diffusers multiplies ``dt * v`` in the model-output dtype before adding to the float32 sample; here the
    product is float32 too, which is the same in float32 and more exact in bfloat16.)
    """
    dt = jnp.asarray(sigma_next, jnp.float32) - jnp.asarray(sigma, jnp.float32)
    out = sample.astype(jnp.float32) + dt * model_output.astype(jnp.float32)
    return out.astype(sample.dtype)
