"""The memory guard's refusal names what would fit (``jaxdit.plan.fit.check_fits``): the same mesh with
--fsdp, --quantize fp8 or both, and the fewest devices on which the run as asked fits."""

from __future__ import annotations

import re

import pytest

from jaxdit.families import FAMILIES
from jaxdit.mesh import ParallelConfig
from jaxdit.models.flux_config import FluxConfig
from jaxdit.plan.cost import step_cost
from jaxdit.plan.fit import check_fits
from jaxdit.plan.workload import Workload


class _Device:
    platform, process_index = "gpu", 0

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def test_a_refusal_names_fsdp_fp8_and_more_devices_with_their_needs():
    config = FluxConfig.preset("flux-dev")
    w = Workload.for_config(config, height=1024, width=1024, steps=28, family=FAMILIES["flux"])
    mesh = ParallelConfig(ulysses=2)
    need = step_cost(w, mesh).memory_bytes
    with pytest.raises(ValueError) as refused:
        check_fits(w, mesh, [_Device(int(need * 0.4))] * 2)
    message = str(refused.value)
    print(message)
    assert "--fsdp: " in message and "--quantize fp8: " in message and "--fsdp --quantize fp8: " in message
    # No configuration of 2 devices holds the bf16 weights in 40% of ulysses2's need; fsdp and FP8
    # together do, and the message says so, and on how many devices the run as asked would fit.
    assert "no configuration of these devices fits" in message
    assert re.search(r"--fsdp --quantize fp8: [\d.]+ GiB \(fits\)", message)
    more = re.search(r"with more devices: (\d+) \(([^)]+)\)", message)
    assert more is not None and int(more.group(1)) > 2
