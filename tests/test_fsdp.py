"""Weight sharding of the block stacks (``ParallelConfig(fsdp=True)``, ``jaxdit.parallel.fsdp``).

- exact: the fsdp step is bit-identical in fp32 to the plain step on tiny FLUX and Wan under
  cfg2 x ulysses2 x ring2, and PipeFusion's tiny-digits run under pipefusion2 x ulysses2;
- memory: the compiled program's argument bytes drop by exactly the stacked weights' share the fsdp
  axes take (a device holds 1/P of every block), and for full-size FLUX.1-dev and Wan2.1-14B (abstract
  shapes, no compile) the per-device weight bytes are 1/P of the replicated ones within 2%;
- the gathers: every stacked parameter is all-gathered once per layer inside the scan's loop body plus
  once before it (the prefetch of layer 0), with exactly the bytes of the local shards;
- Wan's PipeFusion (pipefusion2 x ulysses2, warm-up and pipelined phase) is bit-identical with fsdp;
- ``jaxdit plan --fsdp``: the compiled steps' collectives (all-gathers included) equal the cost model's
  bytes and counts, and the parameters it prices are the compiled program's, on small FLUX (tensor2 x
  ulysses4: gathers of two group sizes) and Wan (cfg2 x ulysses4), and PipeFusion's two programs (FLUX
  pipefusion2 x ulysses2) send what the model says per program; FP8 weights with fsdp likewise.
"""

import dataclasses
import json

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
from jaxdit.pipelines import pipefusion_wan
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
    # Every parameter of the tiny models has a dimension 4 divides: exactly 1/4 of each stays.
    assert params[True] * p == params[False], name
    args = {f: hlo_stats.memory_per_device(c)["argument"] for f, c in compiled.items()}
    assert args[False] - args[True] == params[False] - params[True], (name, args, params)

    gathers = [c for c in hlo_stats.collectives(compiled[True]) if c.kind == "all-gather"]
    plain = [c for c in hlo_stats.collectives(compiled[False]) if c.kind == "all-gather"]
    extra = [c for c in gathers if c not in plain]
    in_loop = [c for c in extra if c.trip_counts]
    assert in_loop and all(c.group_size == p for c in extra), name
    # Per stack of n layers: n gathers in the loop + the prefetch of layer 0 before it = (n + 1) / n;
    # the weights outside the stacks once each (stored split, gathered whole for the step).
    moved = sum(c.count * c.bytes_per_device for c in extra)
    state = forwards[False].inner.state
    expected = (params[False] - _stacked_bytes(state)) // p
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
    # Blocks, embedders, modulation projections and head all split 4 ways; what stays whole (a few norm
    # scales and biases no dimension of which 4 divides) is under 0.01% of the weights.
    assert 0.25 <= ratio < 0.25 * 1.0001, ratio


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


def test_wan_pipefusion_with_fsdp_is_bit_identical():
    rng = np.random.default_rng(3)
    text = (2, wan_tiny.text_len(False), wan_tiny.TEXT_DIM)
    call = dict(
        prompt_embeds=rng.standard_normal(text).astype(np.float32),
        negative_prompt_embeds=rng.standard_normal(text).astype(np.float32),
        height=64,
        width=64,
        num_frames=9,
        num_inference_steps=3,
        guidance_scale=5.0,
        seed=0,
        output_type="latent",
        progress=False,
    )
    runs, gathers = {}, {}
    for fsdp in (False, True):
        where = ParallelConfig(pipefusion=2, ulysses=2, fsdp=fsdp).device_mesh(jax.devices()[:4])
        model = pipefusion_wan.PipeFusionWan.load(wan_tiny.diffusers_folder(False), where, jnp.float32)
        pipe = pipefusion_wan.PipeFusionWanPipeline(model, compiler_options=FAST)
        runs[fsdp] = np.asarray(pipe(**call, num_pipeline_patch=2, warmup_steps=1).latents)
        gathers[fsdp] = model.gathers
    assert not gathers[False] and gathers[True]  # the stage's blocks split over ulysses
    assert np.abs(runs[False]).max() > 0.1
    np.testing.assert_array_equal(runs[True], runs[False])


def test_pipelines_keep_fsdp():
    # A pipeline built on a DeviceMesh hands its fsdp setting to the forward (a bare jax mesh has none).
    from jaxdit.families import FAMILIES as registry

    config = flux_tiny_config()
    where = ParallelConfig(ulysses=2, fsdp=True).device_mesh(jax.devices()[:2])
    pipe = registry["flux"].bare_pipeline(flux.abstract_model(config, jnp.float32), where)
    assert pipe.forward.config.fsdp and pipe.forward.gathers


def flux_tiny_config():
    return flux.FluxConfig(
        in_channels=16, out_channels=16, vec_in_dim=8, context_in_dim=16, hidden_size=64, num_heads=4,
        depth=2, depth_single_blocks=3, axes_dim=(4, 6, 6), guidance_embed=False,
    )  # fmt: skip


def _check_programs(cmp) -> None:
    m, model = cmp.measured, cmp.model
    modelled = model.by_kind(cpu=True)
    assert cmp.unexpected_kinds == [] and modelled["all-gather"]["count"] > 0
    for kind, v in modelled.items():
        assert m.by_kind[kind]["bytes_sent"] == v["bytes_sent"], (model.config.describe(), kind)
        if kind != "all-reduce":  # XLA's combiner may merge all-reduces (tests/test_plan.py)
            assert m.by_kind[kind]["count"] == v["count"], (model.config.describe(), kind)
    assert m.param_bytes == model.param_bytes


def test_plan_verify_prices_fsdp_exactly():
    from test_plan import FLUX_SMALL, flux_small, wan_small

    from jaxdit.plan.cost import pipefusion_programs, step_cost
    from jaxdit.plan.verify import Comparison, lower_step, measure, verify_pipefusion
    from jaxdit.plan.workload import Workload

    P = ParallelConfig
    flux_c, wan_c = P(tensor=2, ulysses=4, fsdp=True), P(cfg=2, ulysses=4, fsdp=True)
    fp8 = dataclasses.replace(flux_small("bfloat16"), fp8=True)
    # Each step compiled once (verify_many would also compile a one-device step, for FLOPs). FP8 weights
    # are gathered as FP8 (the CPU carries them in two bytes).
    (f, w, q) = [
        Comparison(step_cost(load, c), measure(*lower_step(load, c), c)[0], 0)
        for load, c in ((flux_small("bfloat16"), flux_c), (wan_small(), wan_c), (fp8, flux_c))
    ]
    for cmp in (f, w, q):
        _check_programs(cmp)
    assert any(k.dtype == "float8_e4m3fn" for k in q.model.collectives)
    # Without fsdp the same steps hold every block whole and gather nothing.
    plain = step_cost(flux_small("bfloat16"), P(tensor=2, ulysses=4))
    assert "all-gather" not in plain.by_kind() and plain.param_bytes > 2 * f.model.param_bytes

    pf = Workload.for_config(FLUX_SMALL, height=512, width=512, text_tokens=24, steps=4, dtype="bfloat16")
    c = P(pipefusion=2, ulysses=2, fsdp=True)
    (cmp,) = verify_pipefusion(pf, [c])
    modelled = pipefusion_programs(pf, c, cpu=True)
    without = pipefusion_programs(pf, P(pipefusion=2, ulysses=2), cpu=True)
    assert cmp.warmup_measured == modelled["warmup"] > without["warmup"]
    assert cmp.pipelined_measured == modelled["pipelined"] > without["pipelined"]
    assert not cmp.unexpected_kinds


def test_plan_cli_fsdp(capsys):
    from jaxdit.plan.command import parse_config

    assert parse_config("ulysses4 x tensor2 + fsdp") == ParallelConfig(ulysses=4, tensor=2, fsdp=True)
    args = ["plan", "--model", "flux-dev", "--devices", "8", "--json"]
    runs = {}
    for fsdp in (False, True):
        assert cli.main(args + (["--fsdp"] if fsdp else [])) == 0
        runs[fsdp] = {p["config"]: p for p in json.loads(capsys.readouterr().out)["configurations"]}
    plain, sharded = runs[False]["ulysses8"], runs[True]["ulysses8 + fsdp"]
    gathers = [k for k in sharded["collectives"] if k["strategy"] == "fsdp"]
    assert gathers and all(k["kind"] == "all-gather" and k["group"] == 8 for k in gathers)
    assert not [k for k in plain["collectives"] if k["strategy"] == "fsdp"]
    # Every weight of FLUX.1-dev is split 8 ways (measured: 23.80 GB -> 2.98 GB per device).
    assert abs(sharded["param_bytes_per_device"] * 8 / plain["param_bytes_per_device"] - 1) < 0.02
