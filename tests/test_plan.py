"""jaxdit plan: the analytic cost model against compiled programs, the chapter's formulas, the CLI.

The model is held against the compiled HLO on small FLUX and Wan models (the full-size tables are in
docs/parallelism.md; ``jaxdit plan --verify`` prints them): over ulysses8, ring8, ring2 x ulysses4,
cfg2 x ulysses4 (Wan) and tensor2 x ulysses4, every collective kind's bytes sent per device (loop trip
counts included, in the dtype the CPU sends), its count (all-reduces: at most the model's, XLA may merge
them) and the per-device FLOPs equal the model exactly, as docs/parallelism.md says; the per-device FLOPs
summed over the devices exceed a one-device compile of the same step by exactly the modelled duplicated
work.
Token counts no degree divides are included (padding), and the Wan model is compiled in bf16 so that the
CPU's widening of bf16 collectives (and not of fp32 ones) is part of what is checked.
"""

import dataclasses
import json
import os

import jax
import pytest

from jaxdit.cli import main
from jaxdit.mesh import ParallelConfig
from jaxdit.models.flux import FluxConfig
from jaxdit.models.partitioning import named_shardings
from jaxdit.models.wan import WanConfig
from jaxdit.parallel.pipefusion import PipeSchedule
from jaxdit.plan.command import parse_config
from jaxdit.plan.cost import attention_flops, step_cost
from jaxdit.plan.latency import Hardware, timing
from jaxdit.plan.search import all_configs, invalid_reasons, plan
from jaxdit.plan.verify import _abstract_model, verify_many
from jaxdit.plan.workload import Workload
from sharding_rules import rules_for

MIB = 2**20

# Small models: 8 heads (split 8 ways), depths that differ per stack (trip counts), text and video
# lengths that ring x ulysses does not divide.
FLUX_SMALL = FluxConfig(
    in_channels=16,
    out_channels=16,
    vec_in_dim=32,
    context_in_dim=64,
    hidden_size=256,
    num_heads=8,
    depth=2,
    depth_single_blocks=3,
    axes_dim=(8, 12, 12),
    guidance_embed=True,
)
WAN_SMALL = WanConfig(dim=256, ffn_dim=512, num_heads=8, num_layers=2, text_dim=32, freq_dim=32)


def flux_small(dtype: str = "float32") -> Workload:
    return Workload.for_config(FLUX_SMALL, height=512, width=512, text_tokens=21, steps=4, dtype=dtype)


def wan_small(dtype: str = "bfloat16") -> Workload:
    # 9 latent frames of 13 x 15 tokens = 1755 video tokens; 8 text tokens; both CFG branches.
    return Workload.for_config(
        WAN_SMALL, height=208, width=240, frames=33, text_tokens=8, steps=4, dtype=dtype
    )


P = ParallelConfig
VERIFIED = {
    # Every configuration the issue names is compiled for one family or the other (a compile costs
    # seconds whatever the size; CI keeps to eight, two at a time).
    "flux": (flux_small, [P(ulysses=8), P(ring=2, ulysses=4), P(tensor=2, ulysses=4)]),
    "wan": (wan_small, [P(ring=8), P(cfg=2, ulysses=4), P(tensor=2, ulysses=4)]),
}


@pytest.fixture(scope="module")
def comparisons():
    families = list(VERIFIED)
    results = verify_many([(VERIFIED[f][0](), VERIFIED[f][1]) for f in families])
    return dict(zip(families, results, strict=True))


def _cases():
    return [(f, c) for f, (_, cs) in VERIFIED.items() for c in cs]


@pytest.mark.parametrize("family,config", _cases(), ids=lambda x: x if isinstance(x, str) else x.describe())
def test_compiled_step_matches_the_model(comparisons, family, config):
    (cmp,) = [c for c in comparisons[family] if c.model.config == config]
    m, model = cmp.measured, cmp.model
    print(
        f"\n{family} {config.describe()}: bytes {m.bytes_sent:.0f} / {model.bytes_sent(cpu=True):.0f} "
        f"= {cmp.bytes_ratio:.6f}; FLOPs {m.flops} / {model.flops:.0f} = {cmp.flops_ratio:.6f}; "
        f"sum/one device {cmp.summed_flops_ratio:.4f} (model {1 + model.duplicated_flops:.4f})"
    )
    # The design's collectives and nothing else, each kind moving exactly the bytes the model says, as
    # many times as it says; XLA's combiner may merge all-reduces into tuples (FLUX ulysses4 x tensor2:
    # 9 where the model has 11), which changes their count, never their bytes (docs/parallelism.md).
    modelled = model.by_kind(cpu=True)
    assert cmp.unexpected_kinds == []
    assert {k for k, v in m.by_kind.items() if v["count"]} == set(modelled)
    for kind, v in modelled.items():
        assert m.by_kind[kind]["bytes_sent"] == v["bytes_sent"], kind
        if kind == "all-reduce":
            assert m.by_kind[kind]["count"] <= v["count"], kind
        else:
            assert m.by_kind[kind]["count"] == v["count"], kind
    assert cmp.bytes_ratio == 1.0 and cmp.flops_ratio == 1.0
    assert m.flops == model.flops
    # Summed over the devices: one device's FLOPs plus exactly the modelled duplicated work (a ratio of
    # two exact integers, compared to the float rounding of the division).
    assert cmp.summed_flops_ratio == pytest.approx(1 + model.duplicated_flops, rel=1e-12, abs=0)
    assert m.param_bytes == model.param_bytes


def test_cpu_widens_bf16_collectives_only(comparisons):
    # Wan in bf16 with tensor parallelism: the all-to-alls carry bf16 (twice the bytes on CPU), the
    # all-reduces carry fp32 partial sums (the same bytes everywhere).
    (cmp,) = [c for c in comparisons["wan"] if c.model.config == P(tensor=2, ulysses=4)]
    gpu, cpu = cmp.model.by_kind(cpu=False), cmp.model.by_kind(cpu=True)
    assert cpu["all-to-all"]["bytes"] == 2 * gpu["all-to-all"]["bytes"]
    assert cpu["all-reduce"]["bytes"] == gpu["all-reduce"]["bytes"]
    assert cmp.measured.by_kind["all-reduce"]["bytes"] == gpu["all-reduce"]["bytes"]


@pytest.mark.parametrize("family", ["flux", "wan"])
@pytest.mark.parametrize("config", [P(pipefusion=2), P(pipefusion=2, tensor=2, ulysses=2)], ids=P.describe)
def test_parameter_model_follows_the_sharding_rules(family, config):
    # PipeFusion has no compiled step here, but its parameters are the rule table's: shard shapes of
    # the model's own logical axes on a mesh with a pipefusion axis (depths the stages divide; PipeFusion
    # pads a stack to ceil(L/P) blocks per stage otherwise, which is what the model counts).
    from flax import nnx

    if family == "flux":
        w = Workload.for_config(dataclasses.replace(FLUX_SMALL, depth_single_blocks=4), height=256, width=256)
    else:
        w = wan_small()

    state = nnx.state(_abstract_model(w.model, w.dtype))
    mesh = config.make_mesh(jax.devices()[: config.num_devices])
    shardings = named_shardings(state, rules_for(tensor=config.tensor, pipefusion=config.pipefusion), mesh)
    total = 0
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
        n = 1
        for d in s.shard_shape(tuple(x.shape)):
            n *= d
        total += n * x.dtype.itemsize
    assert step_cost(w, config).param_bytes == total


def test_full_size_parameters_and_flops():
    counts = {
        "flux-dev": 11_901_408_320,
        "flux-schnell": 11_891_178_560,
        "wan2.1-t2v-1.3b": 1_418_996_800,
        "wan2.1-t2v-14b": 14_288_491_584,
        "wan2.1-i2v-14b": 16_394_878_784,
    }
    for name, n in counts.items():
        assert step_cost(Workload.create(name, dtype="float32"), P()).param_bytes == 4 * n, name
    flux = Workload.create("flux-dev")
    assert flux.tokens == (512, 4096) and flux.branches == 1
    wan = Workload.create("wan2.1-t2v-14b")
    assert wan.tokens == (75_600,) and wan.context == (512,) and wan.branches == 2
    # Measured from the compiled full-size steps (docs/parallelism.md): Wan ulysses8 duplicates the
    # text K/V on every sequence shard, +0.24% summed FLOPs.
    assert step_cost(Workload.create("wan-14b"), P(ulysses=8)).duplicated_flops == pytest.approx(
        0.00236, abs=5e-5
    )
    assert step_cost(flux, P(ulysses=8)).duplicated_flops < 1e-3  # modulation and embedders


def test_the_chapters_formulas_corrected():
    # Seed chapter: ulysses = 2 * 4 * (N d dtype) (P-1)/P / P per layer counts every byte twice (four
    # tensors already include the output's return trip); ring = 2 (N d dtype)(P-1)/P is right.
    def chapter(n, d, p, dtype=2):
        return 2 * 4 * n * d * dtype * (p - 1) / p / p, 2 * n * d * dtype * (p - 1) / p

    flux = Workload.create("flux-dev")
    wan_one_branch = Workload.create("wan2.1-t2v-14b", branches=1)
    for p in (2, 4, 8):
        u, r = chapter(4608, 3072, p)
        layers = flux.attention_layers
        assert step_cost(flux, P(ulysses=p)).bytes_sent() / layers == pytest.approx(u / 2)
        assert step_cost(flux, P(ring=p)).bytes_sent() / layers == pytest.approx(r)
        # Wan's self-attention has the 75,600 video tokens, not the chapter's 76,112 (text is
        # cross-attention, local on every shard).
        _, r_wan = chapter(75_600, 5120, p)
        assert step_cost(wan_one_branch, P(ring=p)).bytes_sent() / 40 == pytest.approx(r_wan)
    assert chapter(4608, 3072, 2)[0] / MIB == pytest.approx(54.0, abs=0.05)  # the chapter's table
    # PipeFusion sends activations, not K/V: per step independent of depth and stage count.
    sent = {p: step_cost(flux, P(pipefusion=p)).bytes_sent() for p in (2, 4, 8)}
    assert len(set(sent.values())) == 1
    assert sent[2] == 2 * (512 + 4096) * 3072 * 4  # two passes, fp32 residual stream
    # Tensor: FLUX single blocks all-reduce ONCE (linear2), so 76 all-reduces of the sequence, in fp32.
    t = step_cost(flux, P(tensor=4))
    assert sum(c.count for c in t.collectives) == 19 * 4 + 38
    assert t.bytes_sent() == pytest.approx((2 * 19 + 38) * 4608 * 3072 * 4 * 2 * 3 / 4)


def test_numbers_in_the_docs_prose():
    """docs/parallelism.md quotes these from the model, rounded as printed there (the tables are
    ``jaxdit plan``'s output and say so)."""
    gib, mib = 2**30, 2**20
    flux, wan = Workload.create("flux-dev"), Workload.create("wan2.1-t2v-14b")
    one_flux, one_wan = step_cost(flux, P()), step_cost(wan, P())
    assert f"{one_flux.flops / 1e12:.1f}" == "74.4"  # TFLOP per FLUX-dev step
    every_flop_at_480 = Hardware(tflops=480, attention_tflops=480)  # the table's settings
    assert round(timing(one_flux, every_flop_at_480).step * 1e3) == 155  # ms
    assert round(timing(one_wan, every_flop_at_480).step) == 27  # s, both branches
    assert f"{one_flux.param_bytes / 1e9:.1f}" == "23.8" and f"{one_wan.param_bytes / 1e9:.1f}" == "29.0"
    # Finding 6: PipeFusion sends 108 MiB per step at any P; Wan's stale K/V is 124 GB / P.
    assert {step_cost(flux, P(pipefusion=p)).bytes_sent() / mib for p in (2, 4, 8)} == {108.0}
    assert {round(step_cost(wan, P(pipefusion=p)).kv_cache_bytes * p / 1e9) for p in (2, 4, 8)} == {124}
    # Finding 7: tensor4 6.0 GiB against ulysses4 1.13 GiB per FLUX step.
    assert f"{step_cost(flux, P(tensor=4)).bytes_sent() / gib:.1f}" == "6.0"
    assert f"{step_cost(flux, P(ulysses=4)).bytes_sent() / gib:.2f}" == "1.13"
    # Finding 8: Wan over PCIe: ulysses8 25.2 GiB (1.08 s at 25 GB/s) against 3.4 s of compute;
    # cfg2 x ulysses4 21.6 GiB; finding 5: cfg's exchange 4.6 MiB per device.
    u8 = step_cost(wan, P(ulysses=8))
    assert f"{u8.bytes_sent() / gib:.1f}" == "25.2" and f"{u8.bytes_sent() / 25e9:.2f}" == "1.08"
    assert f"{timing(u8, Hardware(link='pcie', tflops=480, attention_tflops=480)).compute:.1f}" == "3.4"
    cfg = step_cost(wan, P(cfg=2, ulysses=4))
    assert f"{cfg.bytes_sent() / gib:.1f}" == "21.6"
    assert f"{cfg.by_kind(cpu=False)['collective-permute']['bytes'] / mib:.1f}" == "4.6"


def test_attention_flops_follow_the_kernels_tiles():
    # 4608 keys in 5 blocks of 922 (two padded), 4608 queries in 2 blocks of 2304.
    assert attention_flops(1, 3, 4608, 4608, 128) == 4 * 3 * 4608 * 4610 * 128
    assert attention_flops(1, 1, 100, 100, 64) == 4 * 100 * 100 * 64


def test_invalid_configurations_say_why():
    flux = Workload.create("flux-dev")
    assert "distilled" in invalid_reasons(flux, P(cfg=2, ulysses=4))[0]
    assert "requests" in invalid_reasons(flux, P(data=2, ulysses=4))[0]
    assert invalid_reasons(Workload.create("flux-dev", requests=2), P(data=2, ulysses=4)) == []
    assert "24 heads" in invalid_reasons(Workload.create("flux-dev"), P(ulysses=16))[0]
    assert "stack of 19 blocks" in invalid_reasons(flux, P(pipefusion=32))[0]
    assert invalid_reasons(Workload.create("wan-14b"), P(cfg=2, ulysses=4)) == []


def test_timing_overlaps_ring_and_pipefusion_only():
    w = Workload.create("wan-14b")
    slow = Hardware(link="pcie", bandwidth_gbs=1.0)
    ulysses = timing(step_cost(w, P(ulysses=8)), slow)
    assert ulysses.comm_exposed == pytest.approx(ulysses.comm_total)
    ring = timing(step_cost(w, P(ring=8)), slow)
    assert 0 < ring.comm_exposed < ring.comm_total
    fast = timing(step_cost(w, P(ring=8)), Hardware(bandwidth_gbs=1e6, latency_s=0.0))
    assert fast.comm_exposed == 0 and fast.step == pytest.approx(fast.compute)
    one = timing(step_cost(w, P()), Hardware())
    assert one.generation == pytest.approx(50 * one.compute)


def test_plan_ranks_every_configuration():
    report = plan(Workload.create("flux-dev"), 8)
    # 6 axes, product 8, cfg <= 2: C(8, 5) = 56 ordered factorisations less the 6 with cfg 4 or 8.
    assert len(report.plans) + len(report.invalid) == len(all_configs(8)) == 50
    assert report.recommended is report.plans[0]
    assert report.recommended.name == "ulysses8"
    assert all(p.valid for p in report.plans) and not any(p.valid for p in report.invalid)
    wan = plan(Workload.create("wan-14b"), 8)
    assert wan.recommended.name == "cfg2 x ulysses4"


def test_parse_config():
    assert parse_config("ring2xulysses4") == P(ring=2, ulysses=4)
    assert parse_config("tensor2 x ulysses4") == P(tensor=2, ulysses=4)
    assert parse_config("cfg=2+ulysses=4") == P(cfg=2, ulysses=4)
    assert parse_config("single") == P()
    with pytest.raises(ValueError, match="ringo"):
        parse_config("ringo2")


def test_cli_json_and_text(capsys):
    assert main(["plan", "--model", "wan-14b", "--devices", "4", "--link", "ib", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workload"]["tokens"] == [75_600] and data["devices"] == 4
    assert data["recommended"] == data["configurations"][0]["config"]
    first = data["configurations"][0]
    assert {"bytes_sent_per_device_per_step", "step_seconds", "generation_seconds"} <= set(first)
    assert all(c["reasons"] for c in data["invalid"])
    assert main(["plan", "--model", "flux-dev", "--height", "1024", "--width", "1024", "--devices", "2"]) == 0
    text = capsys.readouterr().out
    # Two devices: ring and Ulysses send the same bytes and ring's overlap (xDiT measured Ring-2 2.60 s
    # vs Ulysses-2 2.68 s with torch.compile on H100).
    assert "recommended: ring2" in text and "invalid (2)" in text
    assert (
        main(["plan", "--model", "flux-dev", "--devices", "8", "--verify", "--configs", "cfg2xulysses4"]) == 2
    )
    assert "distilled" in capsys.readouterr().err


def test_verify_never_emulates_fewer_devices_than_xla_flags_ask_for():
    """``--verify`` on 4 devices in a fresh process whose XLA_FLAGS ask for 8 (a test worker, a user's
    shell): jax starts with 8. Before, it started with 4, and a pytest worker whose first test ran a
    4-device verify failed every 8-device test after it."""
    import subprocess
    import sys

    script = (
        "from jaxdit.plan.verify import ensure_cpu_devices as e; e(4); import jax; print(len(jax.devices()))"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "8"


def test_verify_pipefusion_in_a_fresh_process_full_size_ti2v():
    """``jaxdit plan --verify`` of a PipeFusion configuration in a fresh process, as a user runs it:
    TI2V-5B at 1280 x 704 x 121 (per-token timesteps, the first frame) on pipefusion2 x ulysses4 compiles
    from abstract shapes, and its two programs send exactly the modelled bytes. Before, the PipeFusion
    check asked jax for its devices before they were emulated, and the run stopped with "1 devices are
    given"."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    argv = ["plan", "--model", "wan2.2-ti2v-5b", "--devices", "8", "--verify"]
    argv += ["--configs", "pipefusion2xulysses4", "--json"]
    script = f"import sys; from jaxdit.cli import main; sys.exit(main({argv!r}))"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (verified,) = json.loads(done.stdout)["verify"]
    assert verified["config"] == "pipefusion2 x ulysses4" and not verified["unexpected_collectives"]
    # Exactly, as the FLUX and Wan PipeFusion checks below (measured 2026-12: 15,257,594,880 B and
    # 381,903,413,760 B, both equal to the model's).
    assert verified["warmup_step_bytes_measured_cpu"] == verified["warmup_step_bytes_modelled_cpu"] > 0
    assert verified["pipelined_bytes_measured_cpu"] == verified["pipelined_bytes_modelled_cpu"] > 0


def test_verify_compiles_flux_pipefusion_and_matches_the_per_program_model():
    """FLUX PipeFusion (pf2 x ulysses2): the runner's warm-up step and its pipelined phase (3 steps as one
    scan, fill/drain bubbles included) send exactly what the plan's model says for the same program. The
    24 text tokens split evenly over the M = 4 patches and 2 Ulysses shards, as FLUX-dev's 512 do at full
    size (docs/parallelism.md's table); the runner pads a text chunk that does not split, which the
    model does not count."""
    from jaxdit.plan.cost import pipefusion_programs
    from jaxdit.plan.verify import lower_step, verify_pipefusion

    w = Workload.for_config(FLUX_SMALL, height=512, width=512, text_tokens=24, steps=4, dtype="bfloat16")
    c = P(pipefusion=2, ulysses=2)
    (cmp,) = verify_pipefusion(w, [c])
    modelled = pipefusion_programs(w, c, cpu=True)
    assert modelled["ticks"] == PipeSchedule(2, 4, 2, w.steps - 1).ticks
    assert cmp.warmup_measured == modelled["warmup"] > 0
    assert cmp.pipelined_measured == modelled["pipelined"] > 0
    assert not cmp.unexpected_kinds
    # A bubble-inclusive phase is more than S-W steady steps: the comparison is per program.
    assert modelled["pipelined"] > (w.steps - 1) * modelled["steady_step"]
    with pytest.raises(ValueError, match="use verify_pipefusion"):
        lower_step(w, c)


def test_verify_compiles_wan_pipefusion_and_matches_the_per_program_model():
    """Wan PipeFusion (cfg2 x pf2, M = P, patches of whole latent rows): the runner's warm-up step and
    pipelined phase send exactly what the plan's model says for each program (nothing is padded)."""
    from jaxdit.plan.cost import pipefusion_programs
    from jaxdit.plan.verify import lower_step, verify_pipefusion

    # 14 latent rows after patchify (13 in wan_small would not split into whole-row patches).
    w = Workload.for_config(WAN_SMALL, height=224, width=240, frames=33, text_tokens=8, steps=4)
    c = P(cfg=2, pipefusion=2)
    (cmp,) = verify_pipefusion(w, [c])
    modelled = pipefusion_programs(w, c, cpu=True)
    assert cmp.warmup_measured == modelled["warmup"] > 0
    assert cmp.pipelined_measured == modelled["pipelined"] > 0
    assert not cmp.unexpected_kinds
    with pytest.raises(ValueError, match="use verify_pipefusion"):
        lower_step(w, c)
