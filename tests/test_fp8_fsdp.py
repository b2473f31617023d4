"""--fsdp with --quantize fp8: the FP8 weights (and their scales) are stored split and gathered as FP8, so
the step is bit-identical in fp32 to the FP8 step without fsdp, in both modes (tiny FLUX, one forward on
cfg2 x ulysses2 x ring2, the mesh tests/test_fsdp.py uses); and the FP8 weights per device are 1/4."""

from __future__ import annotations

import flux_tiny
import jax
import numpy as np
import pytest

from jaxdit.families import FAMILIES
from jaxdit.loading.params import load_params
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux, fp8

CHECKPOINTS = FAMILIES["flux"].checkpoints
MESH = dict(cfg=2, ulysses=2, ring=2)
FAST = {"xla_backend_optimization_level": 0}


@pytest.mark.parametrize("mode", fp8.MODES)
def test_fsdp_fp8_forward_is_bit_identical_to_the_fp8_forward(mode):
    x, _ = flux_tiny.case(True)
    out, weights = {}, {}
    for fsdp in (False, True):
        where = ParallelConfig(**MESH, fsdp=fsdp).device_mesh(jax.devices()[:8])
        # As the pipelines load it (load_model): quantized once placed, then laid out by the rule table.
        model = load_params(flux_tiny.diffusers_folder(True), where, checkpoints=CHECKPOINTS, fp8=mode)
        forward = flux.sharded(model, where, compiler_options=FAST)
        out[fsdp], weights[fsdp] = np.asarray(forward(**x)), forward.param_bytes_per_device()
    np.testing.assert_array_equal(out[True], out[False])
    ratio = weights[True] / weights[False]
    print(f"tiny FLUX fp8 {mode}: {weights[False]} -> {weights[True]} B per device under fsdp ({ratio:.4f})")
    assert 0.25 <= ratio < 0.25 * 1.0001, ratio  # fsdp over ring x ulysses: 4 ways, the scales too
