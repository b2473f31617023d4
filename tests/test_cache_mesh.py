"""Feature caches on the mesh, with the bundled tiny-digits model (FLUX architecture, 2 + 2 blocks).

- Every device takes the same decision: each device writes its own row of a record sharded over every
  mesh axis, and the rows are compared; the decisions also match numpy references of the policies fed
  the ratios the run recorded (tests/test_cache_policies.py has the references).
- The same picture, decisions included, on every mesh as on one device (fp32; cache or not, the
  sharded run differs from the single-device run by float rounding only: ``tolerance.SAME_SEED``).
- tiny-digits' quality holds: the held-out judge reads >= 95% of 100 samples while >= 30% of block
  evaluations are skipped (PSNR and timings: scripts/cache_digits.py, README "Feature caching").
- The compiled step: one ``conditional`` whose skip branch holds no collective; the whole program holds
  the uncached step's collectives plus ONE all-reduce (the metric's two sums), and the step compiles once
  whatever the decisions.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
from test_cache_policies import fbcache_reference, teacache_reference

from jaxdit import hlo_stats
from jaxdit.cache import FirstBlockCache, TeaCache
from jaxdit.hlo_stats import collective_ops
from jaxdit.hlo_stats import parse as hlo_parse
from jaxdit.hlo_stats import walk as hlo_walk
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import digits
from jaxdit.pipelines import tiny_digits as tiny
from jaxdit.pipelines.tiny_digits import tiny_digits

FAST = {"xla_backend_optimization_level": 0}
#: tiny-digits' measured thresholds: each gives a mix of full and skipped steps at 10 steps.
CACHES = {"fbcache": FirstBlockCache(threshold=0.2), "teacache": TeaCache()}
CALL = dict(negative_prompt="", true_cfg_scale=3.0, num_inference_steps=10, seed=7, progress=False)
MESHES = {
    "cfg2_ring2_ulysses2": dict(cfg=2, ring=2, ulysses=2),
    "data2_ulysses4": dict(data=2, ulysses=4),
    "tensor2_cfg2_ulysses2": dict(tensor=2, cfg=2, ulysses=2),
    "ring8": dict(ring=8),  # 20 x 20 pixels: 100 image tokens over 8 shards, 4 of them padding
}


@functools.cache
def _pipeline(mesh_name: str):
    config = ParallelConfig(**MESHES.get(mesh_name, {}))
    return tiny_digits(config.make_mesh(jax.devices()[: config.num_devices]), compiler_options=FAST)


@functools.cache
def _generate(mesh_name: str, cache: str | None):
    size = 20 if mesh_name in ("ring8", "single_20") else 16
    pipe = _pipeline("single" if mesh_name.startswith("single") else mesh_name)
    out = pipe("0123456789", height=size, width=size, cache=CACHES.get(cache), **CALL)
    return out, pipe.last_step


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_every_device_decides_alike_and_as_the_reference(cache):
    out, _ = _generate("cfg2_ring2_ulysses2", cache)
    report = out.cache
    print(report.describe(), report.ran.astype(int), np.round(report.ratios, 3))
    assert report.devices == 8 and report.per_device.shape == (8, 10)
    assert (report.per_device == report.per_device[:1]).all() and report.devices_agree
    policy = CACHES[cache]
    if cache == "fbcache":
        expected = fbcache_reference(report.ratios, policy.threshold)
    else:
        coefficients, threshold = (498.651651, -283.781631, 55.8554382, -3.82021401, 0.264230861), 0.4
        expected = teacache_reference(report.ratios, threshold, coefficients)
    assert report.ran.tolist() == expected
    assert 0 < report.full_steps < report.steps  # both decisions occur
    assert report.skipped_fraction == (report.steps - report.full_steps) * (4 - (cache == "fbcache")) / (
        report.steps * 4
    )


@pytest.mark.parametrize(
    "mesh_name, cache",
    [
        ("cfg2_ring2_ulysses2", "fbcache"),
        ("cfg2_ring2_ulysses2", "teacache"),
        ("data2_ulysses4", "fbcache"),
        ("tensor2_cfg2_ulysses2", "teacache"),
        ("ring8", "fbcache"),
    ],
)
def test_same_picture_and_decisions_on_every_mesh(mesh_name, cache):
    out, _ = _generate(mesh_name, cache)
    single, _ = _generate("single_20" if mesh_name == "ring8" else "single", cache)
    print(f"{mesh_name} {cache}: {out.cache.describe()}")
    assert out.cache.ran.tolist() == single.cache.ran.tolist()
    assert out.cache.devices_agree
    tol.check(out.latents, single.latents, tol.SAME_SEED, f"{mesh_name} {cache} vs one device")


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_digits_stay_recognisable_while_skipping_a_third_of_the_blocks(cache):
    """100 samples (10 per digit), 20 steps, tiny-digits' thresholds: the held-out judge still reads
    >= 95% as asked (100% measured by scripts/cache_digits.py) while >= 30% of block evaluations are
    skipped; the steps run in full and the fraction skipped are the README's table's, at its digits."""
    labels = np.repeat(np.arange(10), 10)
    call = {**CALL, "num_inference_steps": 20, "seed": 1}
    out = _pipeline("single")("".join(map(str, labels)), height=16, width=16, cache=CACHES[cache], **call)
    accuracy = digits.DigitJudge().accuracy(out.images, labels)
    print(f"{out.cache.describe()}; judge {accuracy:.0%}")
    assert out.cache.skipped_fraction >= 0.3
    assert accuracy >= 0.95
    # README "Feature caching": First-Block-Cache 0.2 runs 10 steps in full and skips 38%, TeaCache 0.4 9, 55%.
    readme = {"fbcache": (10, "38%"), "teacache": (9, "55%")}[cache]
    assert (out.cache.full_steps, f"{out.cache.skipped_fraction:.0%}") == readme


def _conditionals(compiled) -> list[list[list[str]]]:
    """For each ``conditional`` of the compiled module, the collectives each branch runs, by kind, once per
    execution (loop trip counts and fusions included), read with jaxdit.hlo_stats' HLO parser."""
    module = hlo_parse._module(compiled)
    found = []
    for comp in module.computations.values():
        for ins in comp.instrs:
            if ins.opcode != "conditional":
                continue
            branches = hlo_walk._callee_list(ins.attrs, "branch_computations") or [
                hlo_walk._callee(ins.attrs, key) for key in ("false_computation", "true_computation")
            ]
            kinds = []
            for branch in branches:
                sites = hlo_walk._expand(module, branch, 1, (), True, lambda s: 0)
                kinds.append(
                    [
                        k
                        for s in sites
                        if (k := collective_ops._kind_of(s.instr.opcode))
                        for _ in range(s.count)
                    ]
                )
            found.append(kinds)
    return found


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_skip_branch_holds_no_collective_and_the_step_compiles_once(cache):
    out, (step, args) = _generate("cfg2_ring2_ulysses2", cache)
    assert step._cache_size() == 1  # ten steps, both decisions taken, one compiled program
    compiled = step.lower(*args).compile()
    conditionals = [c for c in _conditionals(compiled) if any(c)]
    assert len(conditionals) == 1, conditionals
    run, skip = sorted(conditionals[0], key=len, reverse=True)
    assert skip == []
    layers = tiny.CONFIG.depth + tiny.CONFIG.depth_single_blocks
    run_layers = layers - (cache == "fbcache")  # First-Block-Cache runs block 0 outside the conditional
    assert run.count("all-to-all") == 4 * run_layers  # Ulysses: q, k, v, out per attention layer
    assert run.count("collective-permute") == 2 * run_layers  # Ring: K and V, one hop

    _, (plain_step, plain_args) = _generate("cfg2_ring2_ulysses2", None)
    plain = hlo_stats.summarize(plain_step.lower(*plain_args).compile())
    cached = hlo_stats.summarize(compiled)
    reductions = [c for c in hlo_stats.collectives(compiled) if c.kind == "all-reduce"]
    # The metric: ONE all-reduce of its two fp32 sums over all 8 devices; nothing else is added.
    assert plain["all-reduce"]["count"] == 0 and len(reductions) == 1
    assert reductions[0].bytes_per_device == 2 * 4 and reductions[0].group_size == 8
    for kind in ("all-to-all", "collective-permute", "all-gather", "reduce-scatter"):
        assert cached[kind]["count"] == plain[kind]["count"], kind


def test_cli_makes_digits_with_a_cache_on_cfg2_ring2_ulysses2(tmp_path, capsys):
    from jaxdit import cli

    out = tmp_path / "digits.png"
    argv = ["generate", "--use_cfg_parallel", "--ring_degree", "2", "--ulysses_degree", "2"]
    argv += ["--use_teacache", "--steps", "8", "--prompt", "7", "--output", str(out)]
    assert cli.main(argv) == 0 and out.is_file()
    printed = capsys.readouterr().out
    assert "TeaCache (threshold 0.4): " in printed and "decisions identical on all 8 devices" in printed
    assert "MiB per device" in printed


def test_readme_cache_memory_of_flux_dev_on_ulysses8():
    """README "Feature caching": First-Block-Cache on FLUX.1-dev at 1024 px on ulysses8 holds 12.75 MiB per
    device (the joined stream's residual and the image tokens' reference, fp32, over 8 devices), from
    ``CachedForward.bytes_per_device`` on the abstract model (no weights), as ``run_cached`` sizes it."""
    from flax import nnx

    from jaxdit.cache.cached_forward import CachedForward, resolve
    from jaxdit.plan.verify import FAST_COMPILE, _abstract_model
    from jaxdit.plan.workload import Workload

    w = Workload.create("flux-dev")
    mesh = ParallelConfig(ulysses=8).make_mesh(jax.devices()[:8])
    pipe = w.family.bare_pipeline(_abstract_model(w.model, w.dtype), mesh, compiler_options=FAST_COMPILE)
    inputs = pipe.prepare(w.family.example_request(w)).inputs
    den = pipe.denoiser
    layout, names = den.layout(inputs)
    model = nnx.merge(den.forward.graphdef, den.forward.state)
    cached = CachedForward(den.forward, resolve(FirstBlockCache(0.08), model, inputs.grid))
    abstract = {}
    for name, value in inputs.context.items():
        arg = den.forward.inputs[name]
        shape = list(np.shape(value))
        if arg.group is not None:
            shape[arg.seq_axis] = layout.padded_lengths[arg.group]
        abstract[name] = jax.ShapeDtypeStruct(tuple(shape), den.dtype if arg.model_dtype else value.dtype)
    b, _, k = np.shape(inputs.tokens)
    rows = b * (2 if inputs.cfg else 1)
    padded = layout.padded_lengths[den.group]
    abstract["hidden_states"] = jax.ShapeDtypeStruct((rows, padded, k + den.hooks.extra_features), den.dtype)
    abstract["timestep"] = jax.ShapeDtypeStruct((rows,), jnp.float32)
    shapes = cached.state_shapes(layout, names, [abstract[n] for n in names], inputs.steps)
    assert shapes["residual"].shape == (1, 512 + 4096, 3072) and shapes["reference"].shape == (1, 4096, 3072)
    assert f"{cached.bytes_per_device(shapes) / 2**20:.2f}" == "12.75"
