"""FLUX equals diffusers' ``FluxTransformer2DModel`` (fp32, 1e-4) on one device and on every strategy.

Tiny random diffusers models (tests/flux_tiny.py) are saved with ``save_pretrained`` and in BFL layout
(written by inverting the BFL key table), loaded with ``load_transformer`` and compared with diffusers'
own output. Text (7 tokens) and image (3 x 5) lengths are not divisible by the degrees, so every
sharded run pads and masks.
"""

import functools

import flux_tiny
import jax.numpy as jnp
import numpy as np
import pytest

from converters.flux import write_bfl
from jaxdit import load_transformer
from jaxdit.mesh import ParallelConfig

TOL = 1e-4  # the design's fp32 tolerance against PyTorch; never relaxed to pass
SHARDED_TOL = 1e-5  # sharded vs jaxdit's own single-device run

#: Each uses all 8 emulated devices; batch 2 so that data and cfg have something to split.
CONFIGS = {
    "ulysses8": ParallelConfig(ulysses=8),
    "ring8": ParallelConfig(ring=8),
    "ring2_ulysses4": ParallelConfig(ring=2, ulysses=4),
    "cfg2_ulysses4": ParallelConfig(cfg=2, ulysses=4),
    "tensor2_ring2_ulysses2": ParallelConfig(tensor=2, ring=2, ulysses=2),
    "tensor4_ulysses2": ParallelConfig(tensor=4, ulysses=2),
}

#: Halves CPU compile time (every configuration is a new program); numerics are what is tested.
FAST = {"compiler_options": {"xla_backend_optimization_level": 0}}


def _load(path, parallel=None, **kw):
    return load_transformer(path, parallel, **kw, **FAST)


def _max_error(fn, guidance: bool, x=None, ref=None) -> float:
    if x is None:
        x, ref = flux_tiny.case(guidance)
    out = fn(**x)
    assert out.shape == ref.shape
    return float(np.abs(np.asarray(out, np.float32) - ref).max())


@functools.cache
def _single(guidance: bool):
    return _load(flux_tiny.diffusers_folder(guidance))


@functools.cache
def _unsharded(guidance: bool) -> np.ndarray:
    x, _ = flux_tiny.case(guidance)
    return np.asarray(_single(guidance)(**x))


def _check_sharded(fn, guidance: bool, name: str) -> None:
    x, ref = flux_tiny.case(guidance)
    if name == "ring2_ulysses4":  # jax arrays in (padded on device) as well as numpy
        x = {k: None if v is None else jnp.asarray(v) for k, v in x.items()}
    out = np.asarray(fn(**x))
    err = float(np.abs(out - ref).max())
    err_1 = float(np.abs(out - _unsharded(guidance)).max())
    print(
        f"{name} ({'dev' if guidance else 'schnell'}): max |jaxdit - diffusers| = {err:.2e}, vs unsharded {err_1:.2e}"
    )
    assert err < TOL
    assert err_1 < SHARDED_TOL


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_single_device(guidance):
    fn = _single(guidance)
    err = float(np.abs(_unsharded(guidance) - flux_tiny.case(guidance)[1]).max())
    print(f"single device ({'dev' if guidance else 'schnell'}): max |jaxdit - diffusers| = {err:.2e}")
    assert err < TOL
    if guidance:
        # Another shape through the same callable: batch 1, square 4 x 4 image, 5 text tokens, scalar
        # timestep and guidance (broadcast to the batch).
        x = flux_tiny.inputs(guidance, batch=1, text_len=5, grid=(4, 4), seed=3)
        ref = flux_tiny.reference(guidance, x)
        x = {**x, "timestep": float(x["timestep"][0]), "guidance": float(x["guidance"][0])}
        assert _max_error(fn, guidance, x, ref) < TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parallel_dev(name):
    _check_sharded(_load(flux_tiny.diffusers_folder(True), CONFIGS[name]), True, name)


def test_parallel_schnell_data2_ring2_ulysses2():
    fn = _load(flux_tiny.diffusers_folder(False), ParallelConfig(data=2, ring=2, ulysses=2))
    _check_sharded(fn, False, "data2_ring2_ulysses2")


def test_bfl_file(tmp_path):
    # The BFL layout goes through the other key table (fused qkv/linear1/linear2, swapped final
    # modulation), so its output must match diffusers' too. Tiny head_dim: the RoPE split is passed.
    # (tests/test_flux_converters.py checks every layout loads bit-identical parameters.)
    path = write_bfl(flux_tiny.config(True), flux_tiny.state_dict(True), tmp_path / "flux-tiny.safetensors")
    fn = _load(path, config=flux_tiny.config(True))
    err = _max_error(fn, True)
    print(f"BFL file, single device (dev): max |jaxdit - diffusers| = {err:.2e}")
    assert err < TOL


def test_bf16_single_device():
    # bf16 weights and matmuls (norms, RoPE, modulation, softmax statistics in fp32): a few bf16 ulps of
    # the output's scale from the fp32 reference, after four blocks of rounding.
    x, ref = flux_tiny.case(True)
    fn = _load(flux_tiny.diffusers_folder(True), dtype=jnp.bfloat16)
    out = fn(**x)
    assert out.dtype == jnp.bfloat16 and out.shape == ref.shape
    err = float(np.abs(np.asarray(out, np.float32) - ref).max())
    print(
        f"single device bf16 (dev): max |jaxdit - diffusers fp32| = {err:.2e} (|ref| max {np.abs(ref).max():.2f})"
    )
    assert err < 8 * 2.0**-8 * float(np.abs(ref).max())
