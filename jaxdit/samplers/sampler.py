"""The sampler protocol the denoising loops use, and the two samplers bound to it.

A denoising loop (plain or PipeFusion) needs four things from a sampler, whatever its algorithm:

- ``schedule(num_steps, **geometry)``: the host-side tables of one generation (a NamedTuple of numpy
  arrays; the loop places it replicated on the mesh once);
- ``init_state(x)``: the per-sample state carried between steps (a tuple of arrays shaped like ``x``, so
  that it lies exactly like the latents and PipeFusion can slice it per patch; empty for Euler);
- ``model_time(schedule, i)``: what the transformer is called with at step ``i`` (FLUX: the sigma,
  Wan: the integer timestep, as diffusers' pipelines pass them);
- ``step(schedule, i, state, x, v) -> (x, state)``: one update from the model's prediction ``v``.

``i`` is an explicit (possibly traced) step index rather than part of the state, so a loop that runs
different samples at different steps (PipeFusion's patches) indexes the same tables.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxdit.samplers import flow_match_euler as euler
from jaxdit.samplers import unipc

__all__ = ["EulerSampler", "Sampler", "UniPCSampler"]


class Sampler(Protocol):
    def schedule(self, num_steps: int, **geometry: Any) -> Any: ...

    def init_state(self, x: jax.Array) -> tuple[jax.Array, ...]: ...

    def model_time(self, schedule: Any, i: jax.Array) -> jax.Array: ...

    def step(
        self, schedule: Any, i: jax.Array, state: tuple[jax.Array, ...], x: jax.Array, v: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]: ...


@dataclasses.dataclass(frozen=True)
class EulerSampler:
    """Flow-matching Euler (``flow_match_euler``), as FLUX's pipeline uses it: the model sees sigma."""

    config: euler.FlowMatchEulerConfig

    def schedule(self, num_steps: int, *, image_seq_len: int) -> euler.FlowMatchEulerSchedule:
        """FLUX's schedule: ``linear_sigmas(N)`` shifted, dynamically by the image token count if the
        config says so (mu from the config's base/max sequence lengths and shifts)."""
        c = self.config
        mu = (
            euler.dynamic_shift_mu(
                image_seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift
            )
            if c.use_dynamic_shifting
            else None
        )
        return euler.set_timesteps(c, sigmas=euler.linear_sigmas(num_steps), mu=mu)

    def init_state(self, x: jax.Array) -> tuple[jax.Array, ...]:
        return ()

    def model_time(self, schedule: euler.FlowMatchEulerSchedule, i: jax.Array) -> jax.Array:
        return jnp.asarray(schedule.sigmas)[i]

    def step(self, schedule, i, state, x, v):
        sigmas = jnp.asarray(schedule.sigmas)
        return euler.step(x, v.astype(jnp.float32), sigmas[i], sigmas[i + 1]), state


@dataclasses.dataclass(frozen=True)
class UniPCSampler:
    """UniPC on flow sigmas (``unipc``), as Wan's pipeline uses it: the model sees integer timesteps."""

    config: unipc.UniPCConfig

    def schedule(self, num_steps: int, **geometry: Any) -> unipc.UniPCSchedule:
        return unipc.set_timesteps(self.config, num_steps)

    def init_state(self, x: jax.Array) -> tuple[jax.Array, ...]:
        state = unipc.init_state(x)
        return (state.last_sample, state.x0_prev, state.x0_prev2)

    def model_time(self, schedule: unipc.UniPCSchedule, i: jax.Array) -> jax.Array:
        return jnp.asarray(schedule.timesteps)[i].astype(jnp.float32)

    def step(self, schedule, i, state, x, v):
        full = unipc.UniPCState(jnp.asarray(i, jnp.int32), *state)
        x, full = unipc.step(schedule, full, x, v)
        return x, (full.last_sample, full.x0_prev, full.x0_prev2)
