"""``jaxdit plan`` for Z-Image's PipeFusion: the runner's warm-up step and pipelined phase, compiled from
abstract shapes, send exactly the bytes the plan's model says (``cost.pipefusion_programs``), on a small
Z-Image (six heads, two refiner blocks per stream, three joint blocks) whose 24 x 16 token grid splits
into the runner's default 6 patches (3 passes x 2 stages) and whose 96 caption tokens into 6 chunks of
16, as 1024 x 1024's 64 rows and a 128-token caption do into 8 patches of 16. Both guidance branches.

What the plan had to learn (``families/z_image.py``): the refiners attend over the whole patch under
PipeFusion (the other group's keys masked), so their Ulysses exchanges and ring hops cover every token;
the latent patch the last stage hands back holds the image tokens only; and the patch count is the
runner's, a full pipeline of M >= 3P patches that divide the rows (8 / 16 / 32 at 1024 x 1024).
(Full size: ``jaxdit plan --model z-image-turbo --devices 4 --verify`` prints 1.0000 on its PipeFusion
rows.)
"""

from __future__ import annotations

import pytest

from jaxdit.mesh import ParallelConfig as P
from jaxdit.models.z_image_config import ZImageConfig
from jaxdit.parallel.pipefusion import PipeSchedule
from jaxdit.plan.cost import pipefusion_programs, pipeline_shape
from jaxdit.plan.search import evaluate, invalid_reasons
from jaxdit.plan.workload import Workload

SMALL = ZImageConfig(
    dim=192, n_heads=6, n_layers=3, n_refiner_layers=2, cap_feat_dim=64, axes_dims=(8, 12, 12)
)
CONFIGS = [P(pipefusion=2, ulysses=2), P(cfg=2, pipefusion=2, tensor=2)]


@pytest.fixture(scope="module")
def workload():
    w = Workload.for_config(SMALL, height=384, width=256, text_tokens=96, steps=3, dtype="bfloat16")
    assert w.tokens == (384, 96) and w.branches == 2
    return w


@pytest.fixture(scope="module")
def comparisons(workload):
    from jaxdit.plan.verify import verify_pipefusion

    return verify_pipefusion(workload, CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe())
def test_pipefusion_programs_send_the_modelled_bytes(workload, comparisons, config):
    (cmp,) = [c for c in comparisons if c.model.config == config]
    modelled = pipefusion_programs(workload, config, cpu=True)
    print(f"\n{config.describe()}: warm-up {cmp.warmup_measured:.0f} / {modelled['warmup']:.0f} B, "
          f"pipelined {cmp.pipelined_measured:.0f} / {modelled['pipelined']:.0f} B")  # fmt: skip
    assert modelled["patches"] == 6 and modelled["ticks"] == PipeSchedule(2, 6, 3, workload.steps - 1).ticks
    assert not cmp.unexpected_kinds
    assert cmp.warmup_measured == modelled["warmup"] > 0
    assert cmp.pipelined_measured == modelled["pipelined"] > 0


def test_full_size_pipefusion_rows_are_priced_with_the_runners_patches():
    """At 1024 x 1024 the plan prices (and ``--verify`` compiles) the runner's default patch count, the
    rows are runnable, and stages beyond the refiners' 2 blocks are allowed (padded identity slots)."""
    w = Workload.for_config(ZImageConfig.preset("z-image-turbo"), height=1024, width=1024, branches=1)
    assert {p: pipeline_shape(w, P(pipefusion=p)) for p in (2, 4, 8)} == {2: (3, 8), 4: (3, 16), 8: (3, 32)}
    assert pipeline_shape(w, P(pipefusion=2, ring=2, ulysses=2)) == (3, 8)
    for config in (P(pipefusion=2, ulysses=2), P(pipefusion=4), P(pipefusion=8)):
        assert not invalid_reasons(w, config)
        plan = evaluate(w, config, _hardware())
        assert plan.runnable and not any("modelled only" in n for n in plan.notes), plan.notes
    assert "stages for a stack of 30 blocks" in invalid_reasons(w, P(pipefusion=32))[0]


def _hardware():
    from jaxdit.plan.latency import Hardware

    return Hardware(link="nvlink")
