"""Weight sharding of the block stacks (``ParallelConfig(fsdp=True)``, ``jaxdit.parallel.fsdp``).

- exact: the fsdp step is bit-identical in fp32 to the plain step on tiny FLUX and Wan under
  cfg2 x ulysses2 x ring2, and PipeFusion's tiny-digits run under pipefusion2 x ulysses2;
- memory: the compiled program's argument bytes drop by exactly the stacked weights' share the fsdp
  axes take (a device holds 1/P of every block), and for full-size FLUX.1-dev and Wan2.1-14B (abstract
  shapes, no compile) the per-device weight bytes are 1/P of the replicated ones within 2%;
- the gathers: every stacked parameter is all-gathered once per layer inside the scan's loop body plus
  once before it (the prefetch of layer 0), with exactly the bytes of the local shards.
"""

import flux_tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_pipelines
import wan_tiny
from flax import nnx
from PIL import Image

from jaxdit import cli, hlo_stats, load_transformer
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux, wan
from jaxdit.parallel.fsdp import fsdp_axes
from jaxdit.pipelines.tiny_digits import tiny_digits

FAST = {"xla_backend_optimization_level": 0}
MESH = dict(cfg=2, ulysses=2, ring=2)
FAMILIES = {"flux": (flux_tiny, True), "wan": (wan_tiny, False)}


class _Recorded:
    """A family forward's ShardedForward that remembers the global inputs it was called with."""

    def __init__(self, inner):
        self.inner, self.seen = inner, None

    def __call__(self, **inputs):
        self.seen = inputs
        return self.inner(**inputs)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def loaded(request):
    module, flag = FAMILIES[request.param]
    x = module.inputs(flag)
    forwards, outputs = {}, {}
    for fsdp in (False, True):
        fwd = load_transformer(
            module.diffusers_folder(flag), ParallelConfig(**MESH, fsdp=fsdp), compiler_options=FAST
        )
        fwd.forward = _Recorded(fwd.forward)
        outputs[fsdp] = np.asarray(fwd(**x))
        forwards[fsdp] = fwd.forward
    return request.param, outputs, forwards


def test_fsdp_step_is_bit_identical_to_the_plain_step(loaded):
    name, outputs, _ = loaded
    plain, sharded = outputs[False], outputs[True]
    assert np.abs(plain).max() > 0.1, name
    np.testing.assert_array_equal(sharded, plain, err_msg=f"{name}: fsdp vs plain on {MESH}")


def _stacked_bytes(state: nnx.State) -> int:
    """Bytes of every parameter with a leading layer axis (the block stacks)."""
    total = 0
    for name in ("double_blocks", "single_blocks", "blocks"):
        if name in state:
            total += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state[name]))
    return total


def _abstract_inputs(recorded: _Recorded) -> dict:
    return {
        k: jax.ShapeDtypeStruct(np.shape(v), jnp.asarray(v).dtype)
        for k, v in recorded.seen.items()
        if v is not None
    }


def test_compiled_weight_bytes_and_gathers(loaded):
    name, _, forwards = loaded
    compiled, params = {}, {}
    for fsdp, recorded in forwards.items():
        compiled[fsdp] = recorded.inner.lower(**_abstract_inputs(recorded)).compile()
        params[fsdp] = recorded.inner.param_bytes_per_device()
    p = 4  # ring x ulysses: cfg is not an fsdp axis by default
    assert fsdp_axes(ParallelConfig(**MESH, fsdp=True)) == ("ring", "ulysses")
    stacked = _stacked_bytes(forwards[False].inner.state)
    # Every stacked parameter of the tiny models has a dimension 4 divides: exactly 1/4 of them stays.
    assert params[False] - params[True] == stacked - stacked // p, name
    args = {f: hlo_stats.memory_per_device(c)["argument"] for f, c in compiled.items()}
    assert args[False] - args[True] == params[False] - params[True], (name, args, params)

    gathers = [c for c in hlo_stats.collectives(compiled[True]) if c.kind == "all-gather"]
    plain = [c for c in hlo_stats.collectives(compiled[False]) if c.kind == "all-gather"]
    extra = [c for c in gathers if c not in plain]
    in_loop = [c for c in extra if c.trip_counts]
    assert in_loop and all(c.group_size == p for c in extra), name
    # Per stack of n layers: n gathers in the loop + the prefetch of layer 0 before it = (n + 1) / n.
    moved = sum(c.count * c.bytes_per_device for c in extra)
    state = forwards[False].inner.state
    expected = 0
    for stack in ("double_blocks", "single_blocks", "blocks"):
        if stack in state:
            leaves = jax.tree.leaves(state[stack])
            n = leaves[0].shape[0]
            expected += sum(v.size * v.dtype.itemsize for v in leaves) // p // n * (n + 1)
    assert moved == expected, (name, moved, expected)


@pytest.mark.parametrize(
    ("family", "preset", "abstract"),
    [("flux", "flux-dev", flux.abstract_model), ("wan", "wan2.1-t2v-14b", wan.abstract_model)],
)
def test_full_size_weight_bytes_are_one_over_p(family, preset, abstract):
    config = (flux.FluxConfig if family == "flux" else wan.WanConfig).preset(preset)
    model = abstract(config, jnp.bfloat16)
    module = flux if family == "flux" else wan
    per_device = {}
    for fsdp in (False, True):
        where = ParallelConfig(**MESH, fsdp=fsdp).device_mesh(jax.devices()[:8])
        per_device[fsdp] = module.sharded(model, where).param_bytes_per_device()
    ratio = per_device[True] / per_device[False]
    print(
        f"\n{preset}: {per_device[False] / 2**30:.2f} GiB -> {per_device[True] / 2**30:.2f} GiB ({ratio:.4f})"
    )
    stacked = _stacked_bytes(nnx.state(model, nnx.Param))
    # The blocks exactly 1/4; what stays replicated is the embedders, modulation projection and head.
    assert per_device[False] - per_device[True] == stacked - stacked // 4
    if family == "flux":  # FLUX's replicated rest is 0.4% of its weights: the whole is 1/P within 2%
        assert abs(ratio * 4 - 1) < 0.02, ratio
    else:  # Wan's fp32 time projection (5120 x 30720) and text embedding stay: 8.7% over 1/P
        assert 0.25 < ratio < 0.28, ratio


def test_pipefusion_with_fsdp_is_bit_identical():
    call = dict(negative_prompt="", true_cfg_scale=3.0, height=16, width=16, seed=7, progress=False)
    runs, sizes = {}, {}
    for fsdp in (False, True):
        where = ParallelConfig(pipefusion=2, ulysses=2, fsdp=fsdp).device_mesh(jax.devices()[:4])
        pipe = tiny_digits(where, compiler_options=FAST)
        out = pipe("07", **call, num_inference_steps=2, num_pipeline_patch=4, warmup_steps=1)
        runs[fsdp], sizes[fsdp] = np.asarray(out.latents), pipe.model.param_bytes_per_device()
    np.testing.assert_array_equal(runs[True], runs[False])
    assert sizes[True] < sizes[False]  # the stage's own layers are split over ulysses


def test_generate_fsdp_writes_the_same_image(tmp_path, capsys):
    argv = ["generate", "--weights", str(tiny_pipelines.flux_folder()), "--prompt", "a red cube"]
    argv += ["--height", "16", "--width", "24", "--steps", "2", "--max_sequence_length", "8"]
    argv += ["--ulysses_degree", "2"]
    images = {}
    for fsdp in (False, True):
        out = tmp_path / f"{fsdp}.png"
        assert cli.main([*argv, *(["--fsdp"] if fsdp else []), "--output", str(out)]) == 0
        images[fsdp] = np.asarray(Image.open(out))
    assert "+ fsdp" in capsys.readouterr().out
    np.testing.assert_array_equal(images[True], images[False])


class _Device:
    process_index = 0

    def __init__(self, limit: int):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def test_memory_guard_counts_fsdp_and_names_it():
    from jaxdit.families import FAMILIES as registry
    from jaxdit.plan.cost import step_cost
    from jaxdit.plan.fit import check_fits
    from jaxdit.plan.workload import Workload

    config = flux.FluxConfig.preset("flux-dev")
    w = Workload.for_config(config, height=1024, width=1024, steps=28, family=registry["flux"])
    plain = ParallelConfig(ulysses=8)
    need = {f: step_cost(w, ParallelConfig(ulysses=8, fsdp=f)).param_bytes for f in (False, True)}
    assert need[True] < need[False] / 4  # 1/8 of the blocks plus two gathered layers
    with pytest.raises(ValueError, match=r"--fsdp: [\d.]+ GiB \(fits\)"):
        check_fits(w, plain, [_Device(int(step_cost(w, plain).memory_bytes * 0.6))] * 8)
