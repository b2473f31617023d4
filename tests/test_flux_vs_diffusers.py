"""FLUX equals diffusers' ``FluxTransformer2DModel`` (fp32) on one device and on every strategy.

Tiny random diffusers models (tests/flux_tiny.py) are saved with ``save_pretrained`` and in BFL layout
(written by inverting the BFL key table), loaded with ``load_transformer`` and compared with diffusers'
own output. Text (7 tokens) and image (3 x 5) lengths are not divisible by the degrees, so every
sharded run pads and masks. Bounds: tests/tolerance.py (TORCH_FORWARD, TORCH_FORWARD_GUIDANCE_EMBED,
SHARDED, BF16).
"""

import functools

import flux_tiny
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol

from converters.flux import write_bfl
from jaxdit import load_transformer
from jaxdit.mesh import ParallelConfig

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


def _torch_bound(guidance: bool) -> tol.Bound:
    # FLUX-dev's guidance embedding takes sin/cos of guidance x 1000: see TORCH_FORWARD_GUIDANCE_EMBED.
    return tol.TORCH_FORWARD_GUIDANCE_EMBED if guidance else tol.TORCH_FORWARD


def _check_vs_diffusers(fn, guidance: bool, what: str, x=None, ref=None) -> float:
    if x is None:
        x, ref = flux_tiny.case(guidance)
    return tol.check(fn(**x), ref, _torch_bound(guidance), what)


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
    what = f"{name} ({'dev' if guidance else 'schnell'})"
    tol.check(out, ref, _torch_bound(guidance), f"{what} vs diffusers")
    tol.check(out, _unsharded(guidance), tol.SHARDED, f"{what} vs unsharded")


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_single_device(guidance):
    fn = _single(guidance)
    what = f"single device ({'dev' if guidance else 'schnell'})"
    tol.check(_unsharded(guidance), flux_tiny.case(guidance)[1], _torch_bound(guidance), what)
    if guidance:
        # Another shape through the same callable: batch 1, square 4 x 4 image, 5 text tokens, scalar
        # timestep and guidance (broadcast to the batch).
        x = flux_tiny.inputs(guidance, batch=1, text_len=5, grid=(4, 4), seed=3)
        ref = flux_tiny.reference(guidance, x)
        x = {**x, "timestep": float(x["timestep"][0]), "guidance": float(x["guidance"][0])}
        _check_vs_diffusers(fn, guidance, "single device, batch 1, 4 x 4 image, scalar inputs", x, ref)


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
    _check_vs_diffusers(fn, True, "BFL file, single device (dev)")


def test_bf16_single_device():
    # bf16 weights and matmuls (norms, RoPE, modulation, softmax statistics in fp32): a few bf16 ulps of
    # the output's scale from the fp32 reference, after four blocks of rounding.
    x, ref = flux_tiny.case(True)
    fn = _load(flux_tiny.diffusers_folder(True), dtype=jnp.bfloat16)
    out = fn(**x)
    assert out.dtype == jnp.bfloat16 and out.shape == ref.shape
    tol.check(out, ref, tol.BF16, "single device bf16 (dev) vs diffusers fp32")
