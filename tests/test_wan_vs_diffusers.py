"""Wan 2.1 equals diffusers' ``WanTransformer3DModel`` (fp32) on one device and on every strategy.

Tiny random diffusers models (tests/wan_tiny.py), T2V and I2V with the real image path, are saved with
``save_pretrained`` and in the original layout (written by inverting the original key table: 3 shard
files and an index), loaded with ``load_transformer`` and compared with diffusers' own output. The video
token counts (45, 30, 8) are mostly not divisible by the degrees, so sharded runs pad and mask.
Bounds: tests/tolerance.py (TORCH_FORWARD_WAN, SHARDED, BF16).
"""

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
import wan_tiny

from jaxdit.families import load_transformer
from jaxdit.hlo_stats import collectives
from jaxdit.mesh import ParallelConfig
from jaxdit.models import wan

#: Halves CPU compile time (every configuration is a new program); numerics are what is tested.
FAST = {"compiler_options": {"xla_backend_optimization_level": 0}}

#: Each uses all 8 emulated devices; batch 2 so that data and cfg have something to split.
T2V_CONFIGS = {
    "ulysses8": ParallelConfig(ulysses=8),
    "ring8": ParallelConfig(ring=8),
    "ring2_ulysses4": ParallelConfig(ring=2, ulysses=4),
    "cfg2_ulysses4": ParallelConfig(cfg=2, ulysses=4),
    "data2_ring2_ulysses2": ParallelConfig(data=2, ring=2, ulysses=2),
    "tensor2_ring2_ulysses2": ParallelConfig(tensor=2, ring=2, ulysses=2),
    "tensor8": ParallelConfig(tensor=8),
}
#: I2V from the original-layout files, on other shapes.
I2V_CONFIGS = {
    "ring4_ulysses2/f5_4x6": (ParallelConfig(ring=4, ulysses=2), "f5_4x6"),
    "tensor2_ulysses4/f3_6x10": (ParallelConfig(tensor=2, ulysses=4), "f3_6x10"),
    "cfg2_ring2_tensor2/f1_4x8": (ParallelConfig(cfg=2, ring=2, tensor=2), "f1_4x8"),
}


def _error(out, ref) -> float:
    assert out.shape == ref.shape and out.dtype == jnp.float32
    return float(np.abs(np.asarray(out) - np.asarray(ref)).max())


@functools.cache
def _unsharded_fn(i2v: bool):
    return load_transformer(wan_tiny.diffusers_folder(i2v), **FAST)


@functools.cache
def _unsharded(i2v: bool, shape: str) -> np.ndarray:
    """jaxdit's own single-device output: sharded runs must match it within tolerance.SHARDED."""
    x, _ = wan_tiny.case(i2v, shape)
    return np.asarray(_unsharded_fn(i2v)(**x))


def _check_parallel(fn, i2v: bool, shape: str, name: str) -> None:
    x, ref = wan_tiny.case(i2v, shape)
    out = fn(**x)
    what = f"{name} ({'i2v' if i2v else 't2v'} {shape})"
    tol.check_error(_error(out, ref), tol.TORCH_FORWARD_WAN, np.abs(ref).max(), f"{what} vs diffusers")
    unsharded = _unsharded(i2v, shape)
    tol.check_error(_error(out, unsharded), tol.SHARDED, np.abs(unsharded).max(), f"{what} vs unsharded")


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_single_device(i2v):
    fn = _unsharded_fn(i2v)
    assert fn.config == wan_tiny.config(i2v)
    for shape in wan_tiny.SHAPES:  # frame counts 3, 5, 1; non-square
        _, ref = wan_tiny.case(i2v, shape)
        what = f"single device ({'i2v' if i2v else 't2v'} {shape})"
        tol.check_error(_error(_unsharded(i2v, shape), ref), tol.TORCH_FORWARD_WAN, np.abs(ref).max(), what)


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_original_layout_single_device(i2v):
    # Sharded files + index with original names -> the same parameters, hence bit for bit the same output.
    fn = load_transformer(wan_tiny.original_folder(i2v), **FAST)
    assert fn.config == wan_tiny.config(i2v)
    x, ref = wan_tiny.case(i2v)
    out = np.asarray(fn(**x))
    what = f"single device, original layout ({'i2v' if i2v else 't2v'})"
    tol.check_error(_error(out, ref), tol.TORCH_FORWARD_WAN, np.abs(ref).max(), what)
    np.testing.assert_array_equal(out, _unsharded(i2v, wan_tiny.DEFAULT_SHAPE))


@pytest.mark.parametrize("name", list(T2V_CONFIGS))
def test_parallel_t2v(name):
    fn = load_transformer(wan_tiny.diffusers_folder(False), T2V_CONFIGS[name], **FAST)
    _check_parallel(fn, False, wan_tiny.DEFAULT_SHAPE, name)


@pytest.mark.parametrize("name", list(I2V_CONFIGS))
def test_parallel_i2v_original_layout(name):
    parallel, shape = I2V_CONFIGS[name]
    _check_parallel(load_transformer(wan_tiny.original_folder(True), parallel, **FAST), True, shape, name)


def test_small_residual_stream_single_device(tmp_path):
    """LayerNorm's epsilon matters only where a row's variance is small. The T2V model with its patch
    embedding scaled by 1e-2 feeds the first block's LayerNorms rows of ~1e-4 the usual variance: there
    an epsilon ten times too large changes the output by ~5%, where at the usual scale it hides in the
    fp32 difference (measured: 1.0e-5 relative against 7.1e-6 unchanged)."""
    import torch

    model = copy.deepcopy(wan_tiny.model(False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("patch_embedding."):
                p.mul_(1e-2)
    model.save_pretrained(tmp_path / "small-stream")
    x, _ = wan_tiny.case(False)
    with torch.no_grad():
        ref = model(**{k: None if v is None else torch.from_numpy(v) for k, v in x.items()}).sample.numpy()
    out = load_transformer(tmp_path / "small-stream", **FAST)(**x)
    tol.check(out, ref, tol.TORCH_FORWARD_WAN, "patch embedding x 1e-2, single device (t2v)")


def test_bf16_single_device():
    # bf16 weights and matmuls (norms, RoPE, modulation, softmax statistics and the residual stream in
    # fp32): within a few bf16 ulps (2^-8 relative) of the output's scale after two blocks of rounding.
    x, ref = wan_tiny.case(False)
    fn = load_transformer(wan_tiny.diffusers_folder(False), dtype=jnp.bfloat16, **FAST)
    assert fn.dtype == jnp.bfloat16
    tol.check(fn(**x), ref, tol.BF16, "single device bf16 (t2v) vs diffusers fp32")


def test_tensor_parallel_collectives():
    # Per block under tensor parallelism: the two row-parallel all-reduces of attention (self, cross)
    # and the FFN, plus the two small all-reduces of the q/k RMSNorm sums of squares across heads
    # (self-attention q and k in one [B, 2N] all-reduce; cross-attention q and text k in one [B, N + T]).
    parallel = ParallelConfig(tensor=2, ring=2, ulysses=2)
    fn = load_transformer(wan_tiny.diffusers_folder(False), parallel, **FAST)
    x, _ = wan_tiny.case(False)
    cfg = fn.config
    grid = wan.latent_grid(x["hidden_states"].shape, cfg.patch_size)
    patches = wan.patchify(x["hidden_states"], cfg.patch_size)
    spec = lambda a, dtype=jnp.float32: jax.ShapeDtypeStruct(np.shape(a), dtype)
    compiled = fn.forward.lower(
        hidden_states=spec(patches),
        positions=spec(wan.token_positions(grid), jnp.int32),
        timestep=spec(x["timestep"]),
        encoder_hidden_states=spec(x["encoder_hidden_states"]),
    ).compile()
    reduces = [c for c in collectives(compiled) if c.kind == "all-reduce"]
    batch, n_local, text = 2, -(-45 // 4), wan_tiny.text_len(False)
    big = [c for c in reduces if c.operand_shapes[0].dims == (batch, n_local, cfg.dim)]
    small = sorted(c.operand_shapes[0].dims for c in reduces if c not in big)
    assert all(c.count == cfg.num_layers for c in reduces)
    assert len(big) == 3 and small == [(batch, n_local + text), (batch, 2 * n_local)]
    assert {c.kind for c in collectives(compiled)} == {"all-reduce", "all-to-all", "collective-permute"}


def test_input_errors():
    t2v, i2v = _unsharded_fn(False), _unsharded_fn(True)
    x, _ = wan_tiny.case(False)
    with pytest.raises(
        ValueError, match=r"hidden_states has shape \(2, 3, 3, 6, 10\); expected \[B, 4, F, H, W\]"
    ):
        t2v(**{**x, "hidden_states": x["hidden_states"][:, :3]})
    with pytest.raises(ValueError, match="3x6x9 are not multiples of the patch 1x2x2"):
        t2v(**{**x, "hidden_states": x["hidden_states"][..., :9]})
    with pytest.raises(ValueError, match="has no image input"):
        t2v(**{**x, "encoder_hidden_states_image": np.zeros((2, 5, wan_tiny.IMAGE_DIM), np.float32)})
    xi, _ = wan_tiny.case(True)
    with pytest.raises(ValueError, match="needs encoder_hidden_states_image"):
        i2v(**{**xi, "encoder_hidden_states_image": None})
    with pytest.raises(ValueError, match="8 heads cannot be split over ulysses=3"):
        load_transformer(wan_tiny.diffusers_folder(False), ParallelConfig(ulysses=3))
    cfg2 = load_transformer(wan_tiny.diffusers_folder(False), ParallelConfig(cfg=2), **FAST)
    with pytest.raises(ValueError, match="batch 1 cannot be split over data=1 x cfg=2"):
        cfg2(**wan_tiny.inputs(False, batch=1))
