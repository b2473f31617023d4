"""Fusing LoRAs on the mesh (jaxdit/lora.py): what each device holds and computes, switching, exactness.

- memory per device, from the compiled fuse programs: the weight updated in place (donated, output
  aliased), the factors sliced like the weight, temporaries of one layer (fp32);
- the same fused weights on one device, on tensor2 x ulysses2 (stacks in one matmul or layer by layer)
  and in PipeFusion's stage layout (pf2 x ulysses2, pf4 x ulysses2: slots re-ordered for the V-shaped
  second pass and padded), where each layer's update lands in the slot holding that layer and padded
  slots stay zero;
- fuse then unfuse: within one rounding of the fused weight (fp32 and bf16), the measured numbers printed;
- switching in one pass equals fusing the new set into the base;
- a device failure part-way puts back the parameters already changed.
"""

import functools

import flux_tiny
import jax
import jax.numpy as jnp
import lora_tiny
import ml_dtypes
import numpy as np
import pytest
import tolerance as tol
from flax import nnx

from jaxdit import lora as jlora
from jaxdit.families import load_params
from jaxdit.lora import fuse_cost, fuse_loras, fuse_memory, switch_loras, unfuse_loras
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux
from jaxdit.models.partitioning import named_shardings
from jaxdit.pipelines.pipefusion_flux import PipeFusionFlux
from sharding_rules import rules_for

FAST = {"xla_backend_optimization_level": 0}
CFG = flux_tiny.config(lora_tiny.GUIDANCE)


@functools.cache
def _kohya(seed: int = 0, rank: int = 4):
    shapes = lora_tiny.bfl_shapes()
    return lora_tiny.write_kohya_style(
        lora_tiny.ROOT / f"fuse-kohya-{seed}-{rank}.safetensors",
        shapes,
        lora_tiny.linear_modules(shapes),
        prefix="lora_unet_",
        underscore=True,
        rank=rank,
        seed=seed,
    )


def _mesh(**degrees):
    config = ParallelConfig(**degrees)
    return config.make_mesh(jax.devices()[: config.num_devices])


def _model(dtype=None, **degrees):
    return load_params(flux_tiny.diffusers_folder(lora_tiny.GUIDANCE), _mesh(**degrees), dtype)[1]


def _values(state) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def _state(model):
    return nnx.state(model, nnx.Param)


@functools.cache
def _fused_single() -> dict[str, np.ndarray]:
    single = _model()
    fuse_loras(single, CFG, [(_kohya(), 0.7), (_kohya(1, 6), -0.4)], compiler_options=FAST)
    return _values(_state(single))


def _check_weights(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    """Every fused weight within ``tolerance.LORA_WEIGHTS`` of the reference's (relative to that weight)."""
    for k in want:
        tol.check(got[k], want[k], tol.LORA_WEIGHTS, f"{what}: {k}")


def test_memory_per_device(monkeypatch):
    """Per device and parameter, from the compiled programs of stacks updated layer by layer (as stacks
    bigger than WHOLE_STACK_BYTES are; forced here): the weight's own slice, updated in place (donated,
    output aliased), this parameter's factor slices, and temporaries of two fp32 layers of the slice plus
    one layer of factors. The weights are the one-device ones (where stacks go in one matmul)."""
    monkeypatch.setattr(jlora, "WHOLE_STACK_BYTES", 0)
    model = _model(tensor=2, ulysses=2)
    state = _state(model)
    loras = [(_kohya(), 0.7), (_kohya(1, 6), -0.4)]
    costs = fuse_memory(state, CFG, loras, compiler_options=FAST)
    assert len(costs) == 31
    flat = jlora._flat(state)
    for cost in costs:
        value = flat[cost.target].get_value()
        local = value.sharding.shard_shape(value.shape)
        stacked = cost.target.split(".")[0] in ("double_blocks", "single_blocks")
        layers = local[0] if stacked else 1
        d_in, d_out = local[-2:]
        rank = jlora.RANK_STEP
        assert cost.weight == np.prod(local) * 4
        assert cost.extra_output == 0, cost  # the output lives in the donated weight's buffer
        # a and b slices: [layers, in_local, r] and [layers, r, out_local] (b split like the weight's output)
        assert cost.factors == layers * rank * (d_in + d_out) * 4, cost
        one_layer = d_in * d_out * 4
        per_layer = 2 * one_layer + rank * (d_in + d_out) * 4 + 4096
        assert cost.temp <= per_layer, cost
    worst = max(costs, key=lambda c: c.extra / c.weight)
    print(
        f"fuse memory (tensor2 x ulysses2, by layer): at most {worst.extra / worst.weight:.2f} x "
        f"the weight's slice beyond it ({worst.target}: {worst.weight} B weight, {worst.factors} B factors, "
        f"{worst.temp} B temporaries)"
    )
    fuse_loras(state, CFG, loras, compiler_options=FAST)
    _check_weights(
        _values(state), _fused_single(), "fused weights, tensor2 x ulysses2 (by layer) vs one device"
    )


def test_fuse_cost_from_shapes_alone():
    """fuse_cost compiles the programs of a rank-r LoRA on every kernel from shapes (no weights, no file):
    the same per-device memory as fuse_memory reports for a real file of that rank on real weights."""
    mesh = _mesh(tensor=2, ulysses=2)
    state = nnx.state(flux.abstract_model(CFG), nnx.Param)
    shardings = named_shardings(state, rules_for(tensor=2), mesh)
    is_var = lambda x: isinstance(x, nnx.Variable)
    place = lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.get_value()))
    abstract = jax.tree.map(place, state, shardings, is_leaf=is_var)
    estimated = {c.target: c for c in fuse_cost(abstract, 4, compiler_options=FAST)}
    measured = {
        c.target: c
        for c in fuse_memory(_state(_model(tensor=2, ulysses=2)), CFG, [_kohya()], compiler_options=FAST)
    }
    assert set(estimated) == set(measured)  # the LoRA touches every kernel
    for target, cost in estimated.items():
        assert cost == measured[target], target
        assert cost.bytes_moved == 2 * cost.weight + cost.factors


@pytest.mark.parametrize("degrees", [dict(pipefusion=2, ulysses=2), dict(pipefusion=4, ulysses=2)])
def test_pipefusion_stage_layout(degrees):
    """In PipeFusion's stage slots (read by ``PipeFusionFlux.load``; V-ordered: the single blocks' slots
    run backwards; pf4 over 2 layers pads) each layer's update lands in the slot holding that layer:
    the one-device fused weights, re-laid out; padded slots stay exact zeros."""
    staged = PipeFusionFlux.load(flux_tiny.diffusers_folder(lora_tiny.GUIDANCE), _mesh(**degrees))
    loras = [(_kohya(), 0.7), (_kohya(1, 6), -0.4)]
    fuse_loras(staged.state, CFG, loras, stack_orders=staged.orders, compiler_options=FAST)
    got, single = _values(staged.state), _fused_single()
    for key, value in got.items():
        stack = key.split(".", 1)[0]
        want = single[key]
        if stack in staged.orders:
            order = staged.orders[stack]
            keep = (order >= 0).reshape(-1, *[1] * (want.ndim - 1))
            want = np.where(keep, want[np.maximum(order, 0)], 0)
            assert not value[order < 0].any(), key  # padded slots
        tol.check(value, want, tol.LORA_WEIGHTS, f"fused weights, {degrees} stage slots vs one device: {key}")
    if degrees["pipefusion"] == 2:
        assert list(staged.orders["single_blocks"]) == [1, 0]  # the second pass runs backwards
    else:
        assert list(staged.orders["double_blocks"]) == [0, 1, -1, -1]  # padded


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fuse_unfuse_within_one_rounding(dtype):
    """fuse then unfuse: every weight within one rounding (of its dtype) of the fused weight's magnitude."""
    model = _model(jnp.dtype(dtype), tensor=2, ulysses=2)
    state = _state(model)
    base = _values(state)
    fused = fuse_loras(state, CFG, [(_kohya(), 0.9)], compiler_options=FAST)
    during = _values(state)
    unfuse_loras(state, fused)
    back = _values(state)
    worst, exact, total = 0.0, 0, 0
    for key, b in base.items():
        b32, d32, r32 = (x.astype(np.float32) for x in (b, during[key], back[key]))
        ulp = np.spacing(np.maximum(np.abs(b32), np.abs(d32)))
        if b.dtype == ml_dtypes.bfloat16:
            ulp = ulp * 2.0**16  # bf16 keeps 8 of fp32's 24 significant bits
        assert np.all(np.abs(r32 - b32) <= ulp), key
        worst = max(worst, float(np.abs(r32 - b32).max()))
        exact += int((r32 == b32).sum())
        total += b.size
        if not np.array_equal(during[key], b):
            assert not np.array_equal(r32, d32), key  # the update was taken out
    print(f"fuse/unfuse ({dtype}): max |W' - W| = {worst:.2e}; {exact / total:.1%} of weights bit for bit")


def test_switch_equals_fresh_fuse():
    """switch_loras (old out, new in, one pass) gives the weights of fusing the new set into the base."""
    model = _model(tensor=2)
    fused = fuse_loras(model, CFG, [_kohya()], compiler_options=FAST)
    switch_loras(model, CFG, fused, [(_kohya(1, 6), 0.5)])
    fresh = _model(tensor=2)
    fuse_loras(fresh, CFG, [(_kohya(1, 6), 0.5)], compiler_options=FAST)
    _check_weights(_values(_state(model)), _values(_state(fresh)), "switched vs freshly fused")


def test_device_failure_puts_weights_back(monkeypatch):
    """A program failing part-way (here the 4th parameter's): the 3 already changed are put back, by the
    same programs that unfuse runs (so bit for bit what fuse + unfuse gives), the others never changed."""
    reference = _model(tensor=2)
    unfuse_loras(reference, fuse_loras(reference, CFG, [_kohya()], compiler_options=FAST))
    model = _model(tensor=2)
    state = _state(model)
    base = _values(state)
    run, calls = jlora._Job.run, []

    def flaky(job, donate, options):
        calls.append(job.target)
        if len(calls) == 4:
            raise RuntimeError("device lost")
        run(job, donate, options)

    monkeypatch.setattr(jlora._Job, "run", flaky)
    with pytest.raises(RuntimeError, match="device lost"):
        fuse_loras(state, CFG, [_kohya()], compiler_options=FAST)
    assert len(calls) == 4 + 3 and calls[4:] == calls[2::-1]  # 3 done, the 4th failed, 3 put back
    back, want = _values(state), _values(_state(reference))
    for key, value in base.items():
        np.testing.assert_array_equal(back[key], want[key] if key in calls[:3] else value, err_msg=key)
