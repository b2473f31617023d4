"""Samplers vs diffusers 0.42.1 (FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler).

Tolerance policy (float32 throughout, never relaxed to make a test pass):
- schedules: sigmas and timesteps are the same host arithmetic as diffusers, so they must be bit-identical;
- samples: every intermediate sample of a full run, fed the same random model outputs, must be within
  tests/tolerance.py's SAMPLER bound of diffusers' (relative to the tensor's scale, so that entries near
  zero do not make an elementwise relative check meaningless).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from jaxdit.samplers import (
    FlowMatchEulerConfig,
    UniPCConfig,
    dynamic_shift_mu,
    flow_match_euler,
    linear_sigmas,
    unipc,
)

STEPS = [1, 2, 4, 10, 28, 50]
# N = 3 is the first schedule with an order-2 corrector step (the predictor orders are 1, 2, 1).
UNIPC_STEPS = [1, 2, 3, 4, 10, 28, 50]
SHAPE = (2, 4, 8, 8)


def _random_run(num_steps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE, dtype=np.float32)
    model_outputs = rng.standard_normal((num_steps, *SHAPE), dtype=np.float32)
    return x, model_outputs


def _assert_samples_close(ours: np.ndarray, ref: np.ndarray) -> None:
    """Every step's sample within tolerance.SAMPLER of diffusers' (relative to that step's scale)."""
    errors = [(tol.max_error(a, b), float(np.abs(b).max())) for a, b in zip(ours, ref, strict=True)]
    worst = max(range(len(errors)), key=lambda i: errors[i][0] / errors[i][1])
    err, scale = errors[worst]
    tol.check_error(err, tol.SAMPLER, scale, f"worst step ({worst} of {len(errors)})")


# --------------------------------------------------------------------------------------------------------
# Flow-match Euler

# (config kwargs, pass the FLUX pipeline's sigmas, packed image seq len for mu or None)
EULER_CASES = {
    "shift1": (dict(shift=1.0), False, None),
    "shift3": (dict(shift=3.0), False, None),
    "shift5": (dict(shift=5.0), False, None),
    "mu-L256": (dict(use_dynamic_shifting=True), False, 256),
    "mu-L1024": (dict(use_dynamic_shifting=True), False, 1024),
    "mu-L4096": (dict(use_dynamic_shifting=True), False, 4096),
    # FluxPipeline with the FLUX.1-dev scheduler config: linspace sigmas passed in, dynamic shift.
    "flux-dev-L256": (dict(shift=3.0, use_dynamic_shifting=True), True, 256),
    "flux-dev-L1024": (dict(shift=3.0, use_dynamic_shifting=True), True, 1024),
    "flux-dev-L4096": (dict(shift=3.0, use_dynamic_shifting=True), True, 4096),
    # FluxPipeline with sigmas passed and no dynamic shift (schnell-style config, and a shifted one).
    "flux-sigmas-shift1": (dict(shift=1.0), True, None),
    "flux-sigmas-shift3": (dict(shift=3.0), True, None),
}


@jax.jit
def _euler_run(sigmas: jax.Array, x: jax.Array, model_outputs: jax.Array) -> jax.Array:
    def body(x, inputs):
        v, sigma, sigma_next = inputs
        x = flow_match_euler.step(x, v, sigma, sigma_next)
        return x, x

    _, xs = jax.lax.scan(body, x, (model_outputs, sigmas[:-1], sigmas[1:]))
    return xs


@pytest.mark.parametrize("num_steps", STEPS)
@pytest.mark.parametrize("case", list(EULER_CASES))
def test_flow_match_euler_matches_diffusers(case: str, num_steps: int) -> None:
    kwargs, pass_sigmas, seq_len = EULER_CASES[case]
    ref = FlowMatchEulerDiscreteScheduler(**kwargs)
    config = FlowMatchEulerConfig(**kwargs)
    sigmas = linear_sigmas(num_steps) if pass_sigmas else None
    mu = dynamic_shift_mu(seq_len) if seq_len is not None else None
    if sigmas is None:
        ref.set_timesteps(num_steps, mu=calculate_shift(seq_len) if seq_len else None)
        schedule = flow_match_euler.set_timesteps(config, num_steps, mu=mu)
    else:
        ref.set_timesteps(sigmas=sigmas, mu=calculate_shift(seq_len) if seq_len else None)
        schedule = flow_match_euler.set_timesteps(config, sigmas=sigmas, mu=mu)

    assert schedule.sigmas.dtype == np.float32 and schedule.timesteps.dtype == np.float32
    np.testing.assert_array_equal(schedule.sigmas, ref.sigmas.numpy())
    np.testing.assert_array_equal(schedule.timesteps, ref.timesteps.numpy())

    x, model_outputs = _random_run(num_steps, seed=num_steps)
    ref_samples, xt = [], torch.from_numpy(x)
    for t, v in zip(ref.timesteps, model_outputs, strict=True):
        xt = ref.step(torch.from_numpy(v), t, xt).prev_sample
        ref_samples.append(xt.numpy())
    ours = _euler_run(jnp.asarray(schedule.sigmas), jnp.asarray(x), jnp.asarray(model_outputs))
    _assert_samples_close(np.asarray(ours), np.stack(ref_samples))


@pytest.mark.parametrize("seq_len", [256, 1024, 4096, 4080, 75600])
def test_flux_mu_matches_calculate_shift(seq_len: int) -> None:
    assert dynamic_shift_mu(seq_len) == calculate_shift(seq_len)
    assert dynamic_shift_mu(seq_len, 128, 2048, 0.3, 1.2) == calculate_shift(seq_len, 128, 2048, 0.3, 1.2)


def test_flow_match_euler_from_diffusers_config() -> None:
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.4)
    config = FlowMatchEulerConfig.from_diffusers(ref.config)
    assert config == FlowMatchEulerConfig(shift=3.0, use_dynamic_shifting=True, base_shift=0.4)
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        FlowMatchEulerConfig.from_diffusers({**ref.config, "use_karras_sigmas": True})
    with pytest.raises(ValueError, match="mu"):
        flow_match_euler.set_timesteps(config, 4)


def test_flow_match_euler_step_keeps_dtype() -> None:
    x = jnp.ones(SHAPE, jnp.bfloat16)
    out = flow_match_euler.step(x, x, jnp.float32(1.0), jnp.float32(0.5))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.5)


# --------------------------------------------------------------------------------------------------------
# UniPC


@jax.jit
def _unipc_run(schedule: unipc.UniPCSchedule, x: jax.Array, model_outputs: jax.Array) -> jax.Array:
    def body(carry, v):
        x, state = carry
        x, state = unipc.step(schedule, state, x, v)
        return (x, state), x

    _, xs = jax.lax.scan(body, (x, unipc.init_state(x)), model_outputs)
    return xs


@pytest.mark.parametrize("num_steps", UNIPC_STEPS)
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
@pytest.mark.parametrize("order", [2, 1], ids=lambda o: f"order{o}")  # 2 is WanPipeline's
def test_unipc_matches_diffusers(order: int, shift: float, num_steps: int) -> None:
    ref = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=shift,
        solver_order=order,
    )
    ref.set_timesteps(num_steps)
    ref.set_begin_index(0)  # as WanPipeline does
    config = UniPCConfig(flow_shift=shift, solver_order=order)
    schedule = unipc.set_timesteps(config, num_steps)

    assert schedule.sigmas.dtype == np.float32 and schedule.timesteps.dtype == np.int32
    np.testing.assert_array_equal(schedule.sigmas, ref.sigmas.numpy())
    np.testing.assert_array_equal(schedule.timesteps, ref.timesteps.numpy())

    x, model_outputs = _random_run(num_steps, seed=100 + num_steps)
    ref_samples, xt = [], torch.from_numpy(x)
    for t, v in zip(ref.timesteps, model_outputs, strict=True):
        xt = ref.step(torch.from_numpy(v), t, xt).prev_sample
        ref_samples.append(xt.numpy())
    ours = _unipc_run(schedule, jnp.asarray(x), jnp.asarray(model_outputs))
    _assert_samples_close(np.asarray(ours), np.stack(ref_samples))


def test_unipc_from_diffusers_config() -> None:
    # The scheduler WanPipeline builds (the Wan 2.1 diffusers checkpoints' config, with 720p's shift).
    ref = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    config = UniPCConfig.from_diffusers(ref.config)
    assert config == UniPCConfig(flow_shift=5.0)
    with pytest.raises(ValueError, match="prediction_type"):
        UniPCConfig.from_diffusers({**ref.config, "prediction_type": "epsilon"})
    with pytest.raises(ValueError, match="solver_type"):
        UniPCConfig.from_diffusers({**ref.config, "solver_type": "bh1"})
    with pytest.raises(ValueError, match="disable_corrector"):
        UniPCConfig.from_diffusers({**ref.config, "disable_corrector": [0]})


def test_unipc_step_by_step_jit_matches_scan() -> None:
    """Python-loop driving (one jitted step, the index traced inside the state) equals the scan, and keeps
    the sample dtype."""
    schedule = unipc.set_timesteps(UniPCConfig(flow_shift=5.0), 6)
    x, model_outputs = _random_run(6, seed=7)
    step = jax.jit(unipc.step)
    xj = jnp.asarray(x)
    state = unipc.init_state(xj)
    for v in model_outputs:
        xj, state = step(schedule, state, xj, jnp.asarray(v))
    assert int(state.step_index) == 6 and xj.dtype == jnp.float32
    scanned = _unipc_run(schedule, jnp.asarray(x), jnp.asarray(model_outputs))
    tol.check(xj, scanned[-1], tol.SAMPLER, "UniPC step by step (jit) vs the scan")

    xb = jnp.asarray(x, jnp.bfloat16)
    out, _ = step(schedule, unipc.init_state(xb), xb, jnp.asarray(model_outputs[0], jnp.bfloat16))
    assert out.dtype == jnp.bfloat16


def test_unipc_state_keeps_sample_sharding() -> None:
    devices = np.array(jax.devices())
    if SHAPE[0] * 4 % devices.size:
        pytest.skip(f"{devices.size} devices do not divide the batch")
    mesh = jax.sharding.Mesh(devices, ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.device_put(jnp.ones((SHAPE[0] * 4, *SHAPE[1:])), sharding)
    state = unipc.init_state(x)
    assert state.last_sample.sharding == sharding and state.x0_prev2.sharding == sharding
