"""``jaxdit plan`` for HunyuanVideo 1.5 text to video: the compiled step of a small HunyuanVideo 1.5 (four
heads, two dual-stream and two refiner blocks, a 5-frame 64 x 96 video) against the cost model, byte for
byte and FLOP for FLOP, on meshes splitting the sequence, the heads and the CFG branches; and the
PipeFusion runner's warm-up step and pipelined phase, compiled from abstract shapes, send exactly the
bytes the plan's model says (``cost.pipefusion_programs``): the video's 4 latent rows split into the
runner's default 4 patches (2 passes x 2 stages), the 40 prompt and 256 glyph tokens into 4 chunks each.
What the plan had to learn (``families/hunyuan_video15.py``): under PipeFusion the token refiner attends
over the whole patch (the other groups' keys masked), so its Ulysses exchanges and ring hops cover every
token.
Image to video (``families/hunyuan_video15_i2v.py``): the same small transformer's step with the first
frame's conditioning given as zeros of its shapes (729 SigLIP tokens, the 33 condition channels), the
image group padded for the sequence shards, on cfg2 x ulysses2 and ring2 x ulysses2.
(Full size: ``jaxdit plan --model hunyuanvideo1.5-480p --devices 8 --verify`` and the ``-i2v`` presets
print 1.0000 for every configuration they compile; docs/hunyuan-video15.md.)"""

from __future__ import annotations

import pytest

from jaxdit.mesh import ParallelConfig as P
from jaxdit.models.hunyuan_video15_config import HunyuanVideo15Config
from jaxdit.parallel.pipefusion import PipeSchedule
from jaxdit.plan.cost import pipefusion_programs, shapes
from jaxdit.plan.verify import pipefusion_not_compilable, verify_many, verify_pipefusion
from jaxdit.plan.workload import Workload

SMALL = HunyuanVideo15Config(
    in_channels=65, out_channels=32, num_attention_heads=4, attention_head_dim=32, num_layers=2,
    num_refiner_layers=2, text_embed_dim=48, text_embed_2_dim=40, image_embed_dim=24, rope_axes_dim=(8, 12, 12),
)  # fmt: skip
CONFIGS = [P(cfg=2, ulysses=2), P(ring=2, ulysses=2), P(ulysses=2, tensor=2)]


def _workload() -> Workload:
    return Workload.for_config(SMALL, height=64, width=96, frames=5, text_tokens=40, steps=4, dtype="float32")


I2V_CONFIGS = [P(cfg=2, ulysses=2), P(ring=2, ulysses=2)]


def _i2v_workload() -> Workload:
    from jaxdit.families.hunyuan_video15_i2v import HUNYUAN_VIDEO15_I2V

    return Workload.for_config(
        SMALL,
        height=64,
        width=96,
        frames=5,
        text_tokens=40,
        steps=4,
        dtype="float32",
        family=HUNYUAN_VIDEO15_I2V,
    )


@pytest.fixture(scope="module")
def all_comparisons():
    return verify_many([(_workload(), CONFIGS), (_i2v_workload(), I2V_CONFIGS)])


@pytest.fixture(scope="module")
def comparisons(all_comparisons):
    return all_comparisons[0]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe())
def test_compiled_step_matches_the_model(comparisons, config):
    (cmp,) = [c for c in comparisons if c.model.config == config]
    m, model = cmp.measured, cmp.model
    print(f"\n{config.describe()}: bytes {cmp.bytes_ratio:.6f}, FLOPs {cmp.flops_ratio:.6f}")
    modelled = model.by_kind(cpu=True)
    assert cmp.unexpected_kinds == []
    assert {k for k, v in m.by_kind.items() if v["count"]} == set(modelled)
    for kind, v in modelled.items():
        assert m.by_kind[kind]["bytes_sent"] == v["bytes_sent"], kind
    assert cmp.bytes_ratio == 1.0 and cmp.flops_ratio == 1.0
    assert m.flops == model.flops


@pytest.mark.parametrize("config", I2V_CONFIGS, ids=lambda c: c.describe())
def test_i2v_compiled_step_matches_the_model(all_comparisons, config):
    w = _i2v_workload()
    assert w.tokens[3] == 729 and w.family.name == "hunyuan-video15-i2v"
    (cmp,) = [c for c in all_comparisons[1] if c.model.config == config]
    m, model = cmp.measured, cmp.model
    print(f"\ni2v {config.describe()}: bytes {cmp.bytes_ratio:.6f}, FLOPs {cmp.flops_ratio:.6f}")
    modelled = model.by_kind(cpu=True)
    assert cmp.unexpected_kinds == []
    assert {k for k, v in m.by_kind.items() if v["count"]} == set(modelled)
    for kind, v in modelled.items():
        assert m.by_kind[kind]["bytes_sent"] == v["bytes_sent"], kind
    assert cmp.bytes_ratio == 1.0 and cmp.flops_ratio == 1.0
    assert m.flops == model.flops


def test_i2v_example_request_carries_the_first_frame():
    """What --verify lowers: the conditioning the encoders would give, in their shapes (no encoder)."""
    w = _i2v_workload()
    r = w.family.example_request(w)
    assert r.image is None
    assert r.image_embeds.shape == (1, 729, SMALL.image_embed_dim)
    assert r.condition.shape == (1, 33, 2, 4, 6)  # 5 frames -> 2 latent frames of 64 x 96 / 16


PIPEFUSION = [P(pipefusion=2, ulysses=2), P(cfg=2, pipefusion=2), P(pipefusion=2, ring=2)]


@pytest.fixture(scope="module")
def pipefusion_comparisons():
    return verify_pipefusion(_workload(), PIPEFUSION)


@pytest.mark.parametrize("config", PIPEFUSION, ids=lambda c: c.describe())
def test_pipefusion_programs_send_the_modelled_bytes(pipefusion_comparisons, config):
    w = _workload()
    assert pipefusion_not_compilable(w, config) is None
    (cmp,) = [c for c in pipefusion_comparisons if c.model.config == config]
    modelled = pipefusion_programs(w, config, cpu=True)
    print(f"\n{config.describe()}: warm-up {cmp.warmup_measured:.0f} / {modelled['warmup']:.0f} B, "
          f"pipelined {cmp.pipelined_measured:.0f} / {modelled['pipelined']:.0f} B")  # fmt: skip
    assert modelled["patches"] == 4 and modelled["ticks"] == PipeSchedule(2, 4, 2, w.steps - 1).ticks
    assert not cmp.unexpected_kinds
    assert cmp.warmup_measured == modelled["warmup"] > 0
    assert cmp.pipelined_measured == modelled["pipelined"] > 0


def test_i2v_pipefusion_pads_each_patch_chunk_as_the_runner():
    """The 729 image tokens in 4 patches are chunks of 183 (732: 3 pad tokens), each padded for 2 shards
    (184): the plan prices the runner's layout (``plan.cost.shapes``), so the
    compiled programs' bytes equal the model's (dividing the unchunked sequence by M was 0.01-0.1% short
    at full size)."""
    w, config = _i2v_workload(), P(pipefusion=2, ulysses=2)
    assert shapes(w, config).local == (w.tokens[0] // 2, 20, 128, 4 * 92)  # per device, 2 shards
    (cmp,) = verify_pipefusion(w, [config])
    modelled = pipefusion_programs(w, config, cpu=True)
    assert not cmp.unexpected_kinds
    assert cmp.warmup_measured == modelled["warmup"] > 0
    assert cmp.pipelined_measured == modelled["pipelined"] > 0
