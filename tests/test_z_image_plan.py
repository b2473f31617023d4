"""``jaxdit plan`` for Z-Image: the compiled step of a small Z-Image (six heads, two refiner blocks per
stream, three joint blocks) against the cost model, byte for byte and FLOP for FLOP, on meshes whose
refiners attend over one token group each; and the 30-head refusals ranked as the planner ranks them.
(Full size: ``jaxdit plan --model z-image-turbo --devices 4 --verify`` prints the same ratios, 1.0000.)"""

from __future__ import annotations

import pytest

from jaxdit.mesh import ParallelConfig as P
from jaxdit.models.z_image_config import ZImageConfig
from jaxdit.plan.search import invalid_reasons
from jaxdit.plan.verify import verify_many
from jaxdit.plan.workload import Workload

SMALL = ZImageConfig(
    dim=192, n_heads=6, n_layers=3, n_refiner_layers=2, cap_feat_dim=64, axes_dims=(8, 12, 12)
)
CONFIGS = [P(ring=2, ulysses=2), P(cfg=2, tensor=2), P(ring=2, tensor=2)]


@pytest.fixture(scope="module")
def comparisons():
    # 16 x 20 = 320 image tokens, a 40-token caption padded to 64; both CFG branches (the base model).
    w = Workload.for_config(SMALL, height=256, width=320, text_tokens=40, steps=4, dtype="float32")
    assert w.tokens == (320, 64) and w.branches == 2
    return verify_many([(w, CONFIGS)])[0]


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


def test_thirty_heads_are_refused_with_the_reason():
    w = Workload.for_config(ZImageConfig.preset("z-image-turbo"), height=1024, width=1024, branches=1)
    reasons = invalid_reasons(w, P(ulysses=4))
    assert any("30 heads cannot be split over ulysses=4" in r for r in reasons), reasons
    assert not invalid_reasons(w, P(ring=2, ulysses=2))
