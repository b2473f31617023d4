"""UniPC multistep sampler on flow-matching sigmas (Wan 2.1).

UniPC (Zhao et al., "UniPC: A Unified Predictor-Corrector Framework for Fast Sampling of Diffusion
Models", arXiv 2302.04867) in its data-prediction form with B(h) = e^h - 1 ("bh2"), order <= 2. Each step

1. converts the flow prediction to a data prediction, ``x0 = x - sigma * v``;
2. (from the second step on) corrects the current sample with UniC, which re-does the previous update using
   the data prediction just made at the current sample;
3. predicts the next sample with UniP, a linear multistep update in ``lambda = log(alpha / sigma)`` that uses
   the current and (at order 2) the previous data prediction.

Flow sigmas mean ``alpha = 1 - sigma``. The order ramps up from 1 at the first step (one prediction known)
and drops back to 1 at the last step, which lands exactly on the final data prediction (sigma = 0).

Follows diffusers' ``UniPCMultistepScheduler`` (schedulers/scheduling_unipc_multistep.py, diffusers 0.42.1)
configured as ``WanPipeline`` does: ``prediction_type="flow_prediction", use_flow_sigmas=True,
flow_shift=s``, with its defaults ``solver_order=2, solver_type="bh2", lower_order_final=True``, no
``disable_corrector``. Functional split: ``set_timesteps`` runs on the host and bakes every per-step scalar
coefficient into small tables; ``step`` is a pure function of arrays, and the step index lives in the
``UniPCState`` pytree, so a step runs under ``jax.jit`` / ``lax.scan`` with a traced index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "UniPCConfig",
    "UniPCSchedule",
    "UniPCState",
    "init_state",
    "set_timesteps",
    "step",
]


@dataclasses.dataclass(frozen=True)
class UniPCConfig:
    """Static configuration; field names and defaults are those of diffusers' scheduler config."""

    num_train_timesteps: int = 1000
    flow_shift: float = 1.0
    solver_order: int = 2

    def __post_init__(self) -> None:
        if self.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be >= 1, got {self.num_train_timesteps}")
        if not self.flow_shift > 0:
            raise ValueError(f"flow_shift must be > 0, got {self.flow_shift}")
        if self.solver_order not in (1, 2):
            raise ValueError(f"solver_order must be 1 or 2, got {self.solver_order}")

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any]) -> UniPCConfig:
        """Builds the config from a diffusers ``scheduler_config.json`` (or ``scheduler.config``).

        Raises ``ValueError`` for settings this sampler does not implement, rather than ignoring them.
        """
        # (key, value this sampler implements, diffusers' default when the key is absent)
        required = [
            ("prediction_type", "flow_prediction", "epsilon"),
            # bh1 is not offered: with flow sigmas diffusers' bh1 returns NaN on the final step to sigma = 0
            # (B(h) = hh = -inf times a zero residual), so there is no reference behaviour to follow.
            ("solver_type", "bh2", "bh2"),
            ("use_flow_sigmas", True, False),
            ("predict_x0", True, True),
            ("lower_order_final", True, True),
            ("final_sigmas_type", "zero", "zero"),
            ("thresholding", False, False),
            ("use_dynamic_shifting", False, False),
            ("use_karras_sigmas", False, False),
            ("use_exponential_sigmas", False, False),
            ("use_beta_sigmas", False, False),
        ]
        for key, supported, default in required:
            value = config.get(key, default)
            if value != supported:
                raise ValueError(f"scheduler option {key}={value!r} is not supported (only {supported!r})")
        for key in ("disable_corrector", "solver_p", "shift_terminal"):
            if config.get(key):
                raise ValueError(f"scheduler option {key}={config[key]!r} is not supported")
        kwargs = {f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config}
        return cls(**kwargs)


class UniPCSchedule(NamedTuple):
    """Host-side schedule for N steps; all per-step scalars are precomputed.

    sigmas:    float32 [N + 1], decreasing, ending with a terminal 0.
    timesteps: int32 [N], what the model is called with (diffusers' int64 values).
    corrector: float32 [N, 4], UniC weights at step i on (last_sample, x0_prev, x0_prev2 - x0_prev,
               x0 - x0_prev); row 0 is unused (no correction at the first step).
    predictor: float32 [N, 3], UniP weights at step i on (corrected sample, x0, x0_prev - x0).
    """

    sigmas: np.ndarray
    timesteps: np.ndarray
    corrector: np.ndarray
    predictor: np.ndarray


class UniPCState(NamedTuple):
    """Carried between steps; a pytree of float32 arrays shaped like the sample, plus the step index.

    step_index:  int32 scalar, the step about to be taken.
    last_sample: the (corrected) sample the previous step started from.
    x0_prev:     the data prediction made at the previous step.
    x0_prev2:    the data prediction made two steps back.
    """

    step_index: jax.Array
    last_sample: jax.Array
    x0_prev: jax.Array
    x0_prev2: jax.Array


def _flow_sigmas(config: UniPCConfig, num_steps: int) -> np.ndarray:
    """Shifted sigmas, float64 [N]: linspace(1, 1/T, N + 1) without its end point, shifted."""
    sigmas = np.linspace(1.0, 1.0 / config.num_train_timesteps, num_steps + 1)[:-1]
    s = config.flow_shift
    sigmas = s * sigmas / (1 + (s - 1) * sigmas)
    # sigma = 1 means alpha = 0 and lambda = -inf; diffusers nudges it just below 1.
    if abs(sigmas[0] - 1) < 1e-6:
        sigmas[0] -= 1e-6
    return sigmas


def _orders(solver_order: int, num_steps: int) -> np.ndarray:
    """UniP order at each step: warm up from 1 (only one prediction known), and go back to 1 on the final
    step (diffusers' lower_order_final), where the step to sigma = 0 leaves lambda = inf."""
    i = np.arange(num_steps)
    return np.minimum(np.minimum(solver_order, num_steps - i), i + 1)


def _coefficients(config: UniPCConfig, sigmas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-step UniC / UniP weights (see UniPCSchedule) for the float32 sigmas [N + 1].

    Computed in float64 from the float32 sigmas (the values diffusers steps with; near sigma = 1 the
    rounding of 1 - sigma matters), then rounded to float32. diffusers does this arithmetic in float32,
    where the order-2 corrector weight (phi-function differences that cancel for small steps) loses up to
    ~1e-4 relative at 50 steps and ~6e-2 at 1000 (measured with a float32 copy of this function); the
    weight is small, so samples still agree with diffusers to ~1e-6 of their scale at 50 steps.
    """
    n = sigmas.size - 1
    sig = sigmas.astype(np.float32).astype(np.float64)
    alpha = 1 - sig
    with np.errstate(divide="ignore"):
        lam = np.log(alpha) - np.log(sig)  # lam[n] = +inf (sigma = 0)
    orders = _orders(config.solver_order, n)

    corrector = np.zeros((n, 4))
    predictor = np.zeros((n, 3))
    for i in range(n):
        # UniP from sigma[i] to sigma[i + 1]. At the last step h = inf: expm1(-inf) = -1 and the update
        # reduces to x_next = x0.
        h = lam[i + 1] - lam[i]
        hh = -h
        h_phi_1 = np.expm1(hh)
        b_h = h_phi_1  # B(h) = e^hh - 1 (the "bh2" choice)
        predictor[i, 0] = sig[i + 1] / sig[i]
        predictor[i, 1] = -alpha[i + 1] * h_phi_1
        if orders[i] == 2:
            # Order 2 uses the fixed weight 1/2 on the divided difference (x0_prev - x0) / r1.
            r1 = (lam[i - 1] - lam[i]) / h
            predictor[i, 2] = -alpha[i + 1] * b_h * 0.5 / r1

        if i == 0:
            continue
        # UniC redoes the update sigma[i - 1] -> sigma[i] with the order the predictor used there, adding
        # the new data prediction x0 as one more point.
        h = lam[i] - lam[i - 1]
        hh = -h
        h_phi_1 = np.expm1(hh)
        b_h = h_phi_1
        corrector[i, 0] = sig[i] / sig[i - 1]
        corrector[i, 1] = -alpha[i] * h_phi_1
        if orders[i - 1] == 1:
            corrector[i, 3] = -alpha[i] * b_h * 0.5
        else:
            r1 = (lam[i - 2] - lam[i - 1]) / h
            # rho solves R rho = b with R = [[1, 1], [r1, 1]], b_k = k! * h_phi_(k+1) / B(h), writing
            # h_phi_k = hh * phi_k(hh) for phi_0(z) = e^z, phi_(k+1)(z) = (phi_k(z) - 1/k!) / z.
            h_phi_2 = h_phi_1 / hh - 1
            h_phi_3 = h_phi_2 / hh - 0.5
            rho = np.linalg.solve(np.array([[1.0, 1.0], [r1, 1.0]]), np.array([h_phi_2, 2 * h_phi_3]) / b_h)
            corrector[i, 2] = -alpha[i] * b_h * rho[0] / r1
            corrector[i, 3] = -alpha[i] * b_h * rho[1]
    return corrector.astype(np.float32), predictor.astype(np.float32)


def set_timesteps(config: UniPCConfig, num_steps: int) -> UniPCSchedule:
    """Computes the schedule for ``num_steps`` steps on the host (cheap; numpy only)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    sigmas64 = _flow_sigmas(config, num_steps)
    # Timesteps come from the float64 sigmas, truncated toward zero, as in diffusers.
    timesteps = (sigmas64 * config.num_train_timesteps).astype(np.int64).astype(np.int32)
    sigmas = np.concatenate([sigmas64, [0.0]]).astype(np.float32)
    corrector, predictor = _coefficients(config, sigmas)
    return UniPCSchedule(sigmas=sigmas, timesteps=timesteps, corrector=corrector, predictor=predictor)


def init_state(sample: jax.Array) -> UniPCState:
    """Fresh state for a sample; the float32 buffers keep the sample's sharding."""
    zeros = jnp.zeros_like(sample, dtype=jnp.float32)
    return UniPCState(step_index=jnp.zeros((), jnp.int32), last_sample=zeros, x0_prev=zeros, x0_prev2=zeros)


def step(
    schedule: UniPCSchedule,
    state: UniPCState,
    sample: jax.Array,
    model_output: jax.Array,
) -> tuple[jax.Array, UniPCState]:
    """One UniPC step from ``schedule.sigmas[i]`` to ``schedule.sigmas[i + 1]``, ``i = state.step_index``.

    ``model_output`` is the flow prediction (velocity) at ``sample``. Arithmetic and state are float32; the
    returned sample has ``sample``'s dtype. No Python branching on the index: jit / scan friendly.
    """
    i = state.step_index
    x = sample.astype(jnp.float32)
    sigma = jnp.asarray(schedule.sigmas)[i]
    # The data prediction belongs to the sample the model saw, i.e. before this step's correction.
    x0 = x - sigma * model_output.astype(jnp.float32)

    c = jnp.asarray(schedule.corrector)[i]
    corrected = (
        c[0] * state.last_sample
        + c[1] * state.x0_prev
        + c[2] * (state.x0_prev2 - state.x0_prev)
        + c[3] * (x0 - state.x0_prev)
    )
    x = jnp.where(i > 0, corrected, x)

    p = jnp.asarray(schedule.predictor)[i]
    x_next = p[0] * x + p[1] * x0 + p[2] * (state.x0_prev - x0)
    new_state = UniPCState(step_index=i + 1, last_sample=x, x0_prev=x0, x0_prev2=state.x0_prev)
    return x_next.astype(sample.dtype), new_state
