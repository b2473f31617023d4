"""``jaxdit plan`` for FLUX.2's PipeFusion: a small FLUX.2 (four heads, two double and three single blocks,
so a stage holds a padded slot), klein-shaped and dev-shaped (a guidance embedding), on pipefusion2 x
ulysses2, whose compiled warm-up step and pipelined phase (the runner's programs, lowered through the
klein pipeline, or dev's, which prepares the guidance input) send exactly what the plan's model says; and
FLUX.2 [dev]'s full-size PipeFusion rows runnable.

(Full size: ``jaxdit plan --model flux2-klein-4b --devices 4 --verify --configs
pipefusion2xulysses2,pipefusion4,pipefusion2xtensor2`` prints 1.0000 for both programs of each.)
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxdit.mesh import ParallelConfig as P
from jaxdit.models.flux2_config import Flux2Config
from jaxdit.plan.cost import pipefusion_programs
from jaxdit.plan.latency import Hardware
from jaxdit.plan.search import evaluate
from jaxdit.plan.verify import verify_pipefusion
from jaxdit.plan.workload import Workload

SMALL = Flux2Config(
    num_layers=2, num_single_layers=3, attention_head_dim=32, num_attention_heads=4, in_channels=32,
    joint_attention_dim=48, axes_dims_rope=(8, 8, 8, 8), guidance_embeds=False,
    timestep_guidance_channels=64,
)  # fmt: skip


@pytest.mark.parametrize("guidance", [False, True], ids=["klein", "dev"])
def test_verify_compiles_pipefusion_and_matches_the_per_program_model(guidance):
    # 16 x 16 image tokens in 4 patches of 4 rows, 32 text tokens: 8 a patch, 4 a Ulysses shard.
    config = dataclasses.replace(SMALL, guidance_embeds=guidance)
    w = Workload.for_config(config, height=256, width=256, text_tokens=32, steps=4, dtype="bfloat16")
    c = P(pipefusion=2, ulysses=2)
    (cmp,) = verify_pipefusion(w, [c])
    modelled = pipefusion_programs(w, c, cpu=True)
    print(f"\nwarm-up {cmp.warmup_measured:.0f} B, pipelined {cmp.pipelined_measured:.0f} B per device")
    assert cmp.warmup_measured == modelled["warmup"] > 0
    assert cmp.pipelined_measured == modelled["pipelined"] > 0
    assert not cmp.unexpected_kinds


def test_dev_and_klein_pipefusion_rows_are_runnable():
    dev = Workload.for_config(Flux2Config.preset("flux2-dev"), height=1024, width=1024)
    plan = evaluate(dev, P(pipefusion=2, ulysses=4), Hardware())
    assert plan.runnable and not any("modelled only" in n for n in plan.notes), plan.notes
    klein = Workload.for_config(Flux2Config.preset("flux2-klein-4b"), height=1024, width=1024)
    assert evaluate(klein, P(pipefusion=2, ulysses=2), Hardware()).runnable
