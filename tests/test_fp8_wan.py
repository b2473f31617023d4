"""FP8 on Wan (tiny Wan 2.1 T2V): diffusers' fp32 output against jaxdit's forward with the blocks' linear
layers in FP8, weight-only and FP8 matmuls (emulated on the CPU), one forward; the README's quality
figures for Wan, as tests/test_fp8.py's for FLUX. Also: the same FP8-matmul forward on ring2 x ulysses2
x tensor2 equals one device's (each token is scaled alike on every mesh)."""

from __future__ import annotations

import numpy as np
import pytest
import wan_tiny

from jaxdit.families import FAMILIES, load_params
from jaxdit.mesh import ParallelConfig, single_device_mesh
from jaxdit.models import fp8
from jaxdit.models.quantize import quantize_model

FAST = {"compiler_options": {"xla_backend_optimization_level": 0}}


def _forward(parallel: ParallelConfig | None, mode: str | None) -> np.ndarray:
    import jax

    where = (
        single_device_mesh()
        if parallel is None
        else parallel.device_mesh(jax.devices()[: parallel.num_devices])
    )
    _, model = load_params(wan_tiny.diffusers_folder(False), where)
    if mode is not None:
        assert quantize_model(model, mode) > 0
    return np.asarray(FAMILIES["wan"].wrap(model, where, **FAST)(**wan_tiny.case(False)[0]))


@pytest.fixture(scope="module")
def one_device() -> dict:
    return {mode: _forward(None, mode) for mode in (None, *fp8.MODES)}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_wan_fp8_error_against_fp32_is_e4m3_rounding(one_device):
    reference = wan_tiny.case(False)[1]
    exact = _rel(one_device[None], reference)
    weight, matmul = (_rel(one_device[m], reference) for m in fp8.MODES)
    print(
        f"tiny Wan, one forward vs diffusers fp32: fp32 {exact:.2e}, fp8 weight-only {weight:.2e}, "
        f"fp8 matmuls {matmul:.2e} relative"
    )
    assert exact < 1e-4  # the unquantized model is diffusers'
    assert 1e-3 < weight < 2**-4 and weight < matmul < 2**-4  # it rounds, by less than one E4M3 step


def test_wan_fp8_matmuls_on_a_mesh_equal_one_device(one_device):
    # FP8 matmuls, the mode with a collective of its own (a row-parallel layer's token maximum over tensor).
    mode = "matmul"
    out = _forward(ParallelConfig(ring=2, ulysses=2, tensor=2), mode)
    diff = float(np.abs(out - one_device[mode]).max() / np.abs(one_device[mode]).max())
    print(
        f"tiny Wan fp8 {mode} on ring2 x ulysses2 x tensor2 vs one device: {diff:.2e} of the largest output"
    )
    assert diff < 5e-6
