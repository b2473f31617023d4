"""Qwen-Image in ``jaxdit plan``: a small config's compiled denoising step (both CFG branches, the prompts'
key mask) against the cost model, on emulated meshes: every collective kind the model names and no
other, each moving the bytes it says; FLOPs and parameter bytes exact (see tests/test_plan.py for FLUX
and Wan). The key mask's one all-gather per forward is part of the model.
"""

from __future__ import annotations

import pytest

from jaxdit.mesh import ParallelConfig as P
from jaxdit.models.qwen_image_config import QwenImageConfig
from jaxdit.plan.verify import verify_many
from jaxdit.plan.workload import Workload

# 8 heads, 2 blocks; 21 text tokens and 16 x 16 image tokens, which ring x ulysses = 4 pads the text of.
SMALL = QwenImageConfig(
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=8,
    joint_attention_dim=64,
    axes_dims_rope=(8, 12, 12),
)
CONFIGS = [P(ulysses=4), P(ring=2, ulysses=2), P(cfg=2, tensor=2)]


@pytest.fixture(scope="module")
def comparisons():
    w = Workload.for_config(SMALL, height=256, width=256, text_tokens=21, steps=4, dtype="float32")
    assert w.branches == 2
    (results,) = verify_many([(w, CONFIGS)])
    return results


@pytest.mark.parametrize("config", CONFIGS, ids=P.describe)
def test_compiled_step_matches_the_model(comparisons, config):
    (cmp,) = [c for c in comparisons if c.model.config == config]
    m, model = cmp.measured, cmp.model
    print(f"\nqwen-image {config.describe()}: bytes {cmp.bytes_ratio:.6f}, FLOPs {cmp.flops_ratio:.6f}")
    modelled = model.by_kind(cpu=True)
    assert cmp.unexpected_kinds == []
    assert {k for k, v in m.by_kind.items() if v["count"]} == set(modelled)
    for kind, v in modelled.items():
        assert m.by_kind[kind]["bytes_sent"] == v["bytes_sent"], kind
        if kind == "all-reduce":  # XLA's combiner may merge all-reduces (never their bytes)
            assert m.by_kind[kind]["count"] <= v["count"], kind
        else:
            assert m.by_kind[kind]["count"] == v["count"], kind
    if config.sequence_degree > 1:
        assert "all-gather" in modelled  # the prompts' key mask, once per forward
    assert cmp.bytes_ratio == 1.0 and cmp.flops_ratio == 1.0
    assert m.param_bytes == model.param_bytes
