"""FP8 weights (``jaxdit.models.fp8``, ``jaxdit.models.quantize``): exact where they can be, bounded where
FP8 rounds, the same on every mesh, FP8 operands in the program lowered for a GPU, half the bytes.

- weight-only FP8 is exactly the model with its weights replaced by their FP8 values (so the only error
  is the weights' rounding), and equal on every mesh to one device;
- FP8 matmuls quantize each token by its own maximum, so one forward on ring/ulysses/tensor meshes equals
  one device; their error against fp32 is bounded by E4M3's rounding;
- the program lowered for cuda feeds every quantized layer's dot two f8E4M3FN operands;
- a ``jaxdit convert --quantize fp8`` folder restores bit-identically; the bundled tiny-digits keeps its
  judge through ``jaxdit generate --quantize fp8``; combinations that cannot run end in one line.
"""

from __future__ import annotations

import re

import flux_tiny
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxdit import cli
from jaxdit.families import load_params
from jaxdit.generate_checks import check_run
from jaxdit.generate_request import GenerateRequest
from jaxdit.mesh import ParallelConfig, single_device_mesh
from jaxdit.models import flux, fp8
from jaxdit.models.quantize import fp8_layers, quantize_model

#: FLUX's block linear layers (tiny model): per double block q, k, v, proj, fc1, fc2 for each of two
#: streams; per single block q, k, v, mlp_in, out_attn, out_mlp. Modulation stays unquantized.
FLUX_FP8_LAYERS = 18
MESHES = [dict(ring=2, ulysses=2, tensor=2)]


def _mesh(degrees: dict) -> jax.sharding.Mesh:
    config = ParallelConfig(**degrees)
    return config.make_mesh(jax.devices()[: config.num_devices])


@pytest.fixture(scope="module")
def case():
    return flux_tiny.case(True)


def _forward(case, mesh, mode=None) -> np.ndarray:
    _, model = load_params(flux_tiny.diffusers_folder(True), mesh)
    if mode is not None:
        assert quantize_model(model, mode) == FLUX_FP8_LAYERS
    return np.asarray(flux.sharded(model, mesh)(**case[0]))


@pytest.fixture(scope="module")
def one_device(case):
    return {mode: _forward(case, single_device_mesh(), mode) for mode in fp8.MODES}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_kernel_quantization_is_per_channel_within_half_an_e4m3_step():
    w = jax.random.normal(jax.random.key(0), (3, 64, 48)) * jnp.linspace(0.01, 10.0, 48)
    w = w.at[1, :, 5].set(0.0)  # an all-zero channel keeps scale 1 and zeros
    q, scale = fp8.quantize_kernel(w)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (3, 48) and scale.dtype == jnp.float32
    amax = np.abs(np.asarray(w)).max(axis=1)
    np.testing.assert_allclose(np.asarray(scale)[amax > 0], amax[amax > 0] / 448.0, rtol=1e-6)
    assert float(scale[1, 5]) == 1.0 and not np.asarray(q[1, :, 5], np.float32).any()
    back = np.asarray(q, np.float32) * np.asarray(scale)[:, None, :]
    # E4M3 keeps 3 mantissa bits: rounding to nearest is within 2^-4 of the value (normal range), and
    # values below the smallest normal (2^-6 of a channel's scale) within half its subnormal step.
    bound = np.maximum(np.abs(np.asarray(w)) * 2.0**-4, np.asarray(scale)[:, None, :] * 2.0**-10)
    assert np.all(np.abs(back - np.asarray(w)) <= bound * (1 + 1e-6))


def test_weight_only_is_the_model_with_fp8_weights(case, one_device):
    mesh = single_device_mesh()
    _, model = load_params(flux_tiny.diffusers_folder(True), mesh)
    for _, layer in fp8_layers(model):
        q, scale = fp8.quantize_kernel(layer.kernel[...])
        layer.kernel.set_value(q.astype(jnp.float32) * scale[..., None, :])
    rounded_weights = np.asarray(flux.sharded(model, mesh)(**case[0]))
    np.testing.assert_allclose(one_device["weight"], rounded_weights, rtol=0, atol=2e-5)
    error = _rel(one_device["weight"], case[1])
    print(f"fp8 weight-only vs fp32 (tiny FLUX, one forward): {error:.2e} relative")
    assert 1e-3 < error < 2**-4  # it does round, and by less than one E4M3 step


def test_fp8_matmul_error_against_fp32_is_e4m3_rounding(case, one_device):
    error = _rel(one_device["matmul"], case[1])
    print(f"fp8 matmuls vs fp32 (tiny FLUX, one forward): {error:.2e} relative")
    assert _rel(one_device["weight"], case[1]) < error < 2**-4  # activations round too


@pytest.mark.parametrize("mode", fp8.MODES)
@pytest.mark.parametrize("degrees", MESHES, ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()))
def test_every_mesh_equals_one_device(case, one_device, mode, degrees):
    out = _forward(case, _mesh(degrees), mode)
    np.testing.assert_allclose(out, one_device[mode], rtol=0, atol=5e-6)


def test_program_lowered_for_cuda_feeds_fp8_operands_to_every_quantized_dot(case):
    mesh = _mesh(dict(ring=2, ulysses=2, tensor=2))
    abstract = flux.abstract_model(flux_tiny.config(True), jnp.bfloat16)
    inputs = {k: jax.ShapeDtypeStruct(np.shape(v), jnp.asarray(v).dtype) for k, v in case[0].items()}
    texts = {}
    for mode in fp8.MODES:
        model = flux.abstract_model(flux_tiny.config(True), jnp.bfloat16)
        quantize_model(model, mode)
        texts[mode] = flux.sharded(model, mesh).lower(lowering_platforms=("cuda",), **inputs).as_text()
    plain = flux.sharded(abstract, mesh).lower(lowering_platforms=("cuda",), **inputs).as_text()
    f8_dot = re.compile(r"stablehlo\.dot_general[^\n]*\(tensor<[^>]*f8E4M3FN>, tensor<[^>]*f8E4M3FN>\)")
    # Each quantized layer's matmul appears once (the blocks are scanned), with two FP8 operands.
    assert len(f8_dot.findall(texts["matmul"])) == FLUX_FP8_LAYERS
    assert not f8_dot.findall(texts["weight"]) and not f8_dot.findall(plain)
    assert "f8E4M3FN" in texts["weight"]  # its weights arrive as FP8 and are converted in the program


def test_fp8_halves_the_bytes_of_the_layers_it_quantizes():
    mesh = _mesh(dict(ulysses=8))  # weights replicated: a device holds every byte
    config = flux.FluxConfig.preset("flux-dev")
    bf16 = flux.sharded(flux.abstract_model(config, jnp.bfloat16), mesh).param_bytes_per_device()
    model = flux.abstract_model(config, jnp.bfloat16)
    quantize_model(model, "weight")
    quantized = flux.sharded(model, mesh).param_bytes_per_device()
    layers = [layer for _, layer in fp8_layers(model)]
    kernels = sum(layer.kernel.get_value().size for layer in layers)
    scales = sum(layer.kernel_scale.get_value().size for layer in layers)
    # Each quantized weight drops from 2 bytes to 1; each output channel gains a 4-byte scale.
    assert quantized == bf16 - kernels + 4 * scales
    print(
        f"flux-dev per device: bf16 {bf16 / 2**30:.2f} GiB, fp8 {quantized / 2**30:.2f} GiB "
        f"({kernels / 1e9:.2f} B of {bf16 / 2e9:.2f} B parameters in FP8; AdaLN modulation stays bf16)"
    )
    assert quantized < 0.65 * bf16


def test_convert_quantize_fp8_restores_bit_identically(case, one_device, tmp_path):
    dst = tmp_path / "fp8"
    assert cli.main(["convert", str(flux_tiny.diffusers_folder(True)), str(dst), "--quantize", "fp8"]) == 0
    _, model = load_params(dst, single_device_mesh())
    kernels = [layer.kernel[...] for _, layer in fp8_layers(model)]
    assert len(kernels) == FLUX_FP8_LAYERS and all(k.dtype == ml_dtypes.float8_e4m3fn for k in kernels)
    np.testing.assert_array_equal(
        np.asarray(flux.sharded(model, single_device_mesh())(**case[0])), one_device["weight"]
    )
    with pytest.raises(ValueError, match="FP8 already"):
        quantize_model(model, "weight")


def test_generate_tiny_digits_fp8_on_a_mesh_equals_one_device_and_keeps_the_judge(tmp_path, capsys):
    out = tmp_path / "digits.png"
    argv = ["generate", "--emulate_devices", "4", "--ring_degree", "2", "--ulysses_degree", "2"]
    argv += ["--prompt", "0123456789", "--compare_single_device", "--quantize", "fp8", "--fp8_mode", "weight"]
    assert cli.main([*argv, "--output", str(out)]) == 0
    text = capsys.readouterr().out
    difference = float(re.search(r"single-device result: ([0-9.e+-]+)", text).group(1))
    assert difference < 1e-5, text
    assert "recognises 10 of 10" in text and out.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"fp8_mode": "matmul"}, "--fp8_mode matmul applies with --quantize fp8"),
        ({"quantize": "fp8", "pipefusion_parallel_degree": 2}, "without PipeFusion"),
        (
            {"quantize": "fp8", "lora": ("style.safetensors",)},
            "jaxdit convert SRC DST --lora FILE --quantize fp8",
        ),
    ],
)
def test_combinations_that_cannot_run_are_refused_before_loading(flags, message):
    request = GenerateRequest(prompt="7", **flags)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_run(request)


def test_matmul_falls_back_to_weight_only_on_a_gpu_without_fp8_with_one_warning():
    class Device:
        def __init__(self, platform, capability=None):
            self.platform, self.compute_capability = platform, capability

    with pytest.warns(UserWarning, match="compute capability 8.9"):
        assert fp8.choose_mode("matmul", [Device("gpu", "8.0")]) == "weight"
    assert fp8.choose_mode(None, [Device("gpu", "9.0")] * 2) == "matmul"
    assert fp8.choose_mode(None, [Device("gpu", "8.6")]) == "weight"
    assert fp8.choose_mode(None, [Device("cpu")]) == "weight"
    assert fp8.choose_mode("matmul", [Device("cpu")]) == "matmul"  # emulated


# ----------------------------------------------------------------------------------------------------
# FP8 checkpoints as downloaded (ComfyUI's scaled and plain FP8 files)
# ----------------------------------------------------------------------------------------------------


def _comfyui_fp8_file(path, *, scaled: bool, bad_scale: bool = False):
    """tiny FLUX as ComfyUI writes FP8 files: ``model.diffusion_model.`` keys, the blocks' 2-D weights in
    float8_e4m3fn with a per-tensor ``scale_weight`` (scaled) or cast as they are (plain); the source
    file (fp32) is written beside it."""
    import torch
    from safetensors.torch import load_file, save_file

    from converters.flux import BFL_PREFIX, write_bfl

    source = write_bfl(
        flux_tiny.config(True),
        flux_tiny.state_dict(True),
        path.with_suffix(".source.safetensors"),
        prefix=BFL_PREFIX,
    )
    tensors = load_file(str(source))
    out, rounded = {}, {}
    for key, value in tensors.items():
        if "blocks." in key and key.endswith(".weight") and value.ndim == 2:
            scale = value.abs().max() / 448.0 if scaled else torch.tensor(1.0)
            q = (value / scale).to(torch.float8_e4m3fn)
            out[key] = q
            if scaled:
                out[key[: -len("weight")] + "scale_weight"] = scale.reshape(()).float()
            rounded[key] = q.float() * scale
        else:
            out[key] = value
    if scaled:
        out["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    if bad_scale:
        key = next(k for k in out if k.endswith("scale_weight"))
        out[key] = torch.ones(3)
    save_file(out, str(path))
    return path, tensors, rounded


@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "plain"])
def test_a_comfyui_fp8_flux_file_loads_as_the_weights_it_stands_for(case, tmp_path, scaled):
    from converters.checkpoint_files import open_checkpoint

    path, _, rounded = _comfyui_fp8_file(tmp_path / "flux-fp8.safetensors", scaled=scaled)
    files = open_checkpoint(path)
    assert "scaled_fp8" not in files and not any(k.endswith("scale_weight") for k in files)
    key = next(iter(rounded))
    np.testing.assert_array_equal(files.read(key), rounded[key].numpy())  # value x scale, exactly
    mesh = single_device_mesh()
    _, model = load_params(path, mesh, jnp.float32, config=flux_tiny.config(True))
    out = np.asarray(flux.sharded(model, mesh)(**case[0]))
    _, bf16 = load_params(
        path.with_suffix(".source.safetensors"), mesh, jnp.float32, config=flux_tiny.config(True)
    )
    reference = np.asarray(flux.sharded(bf16, mesh)(**case[0]))
    error = _rel(out, reference)
    print(f"ComfyUI {'scaled' if scaled else 'plain'} FP8 file vs its fp32 source: {error:.2e} relative")
    assert 1e-4 < error < 2**-4


def test_an_fp8_scale_of_another_shape_is_refused_by_name(tmp_path):
    from converters.checkpoint_files import open_checkpoint
    from converters.errors import CheckpointError

    path, _, _ = _comfyui_fp8_file(tmp_path / "bad.safetensors", scaled=True, bad_scale=True)
    with pytest.raises(CheckpointError, match=r"scale_weight' has shape \(3,\)"):
        open_checkpoint(path)


def test_serve_holds_fp8_weights_and_refuses_offloading_encoders_it_has_not():
    from jaxdit.serve.engine import Engine

    engine = Engine.load(None, _mesh(dict(ulysses=2)), quantize="fp8", fp8_mode="weight")
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(engine.pipe.forward.state)}
    assert jnp.dtype(jnp.float8_e4m3fn) in dtypes
    with pytest.raises(ValueError, match="--offload_encoders .* would change nothing"):
        Engine.template_for(None, ParallelConfig(), offload_encoders=True)


@pytest.mark.parametrize(
    ("name", "degrees"),
    [
        ("flux-dev", dict(ulysses=8)),
        ("flux-dev", dict(ulysses=4, tensor=2)),
        ("wan2.1-t2v-14b", dict(ulysses=4, tensor=2)),
    ],
)
def test_the_planner_prices_fp8_weights_as_the_sharded_model_holds_them(name, degrees):
    from jaxdit.models import wan
    from jaxdit.plan.cost import step_cost
    from jaxdit.plan.workload import Workload

    module = flux if name.startswith("flux") else wan
    config = (flux.FluxConfig if module is flux else wan.WanConfig).preset(name)
    parallel = ParallelConfig(**degrees)
    model = module.abstract_model(config, jnp.bfloat16)
    quantize_model(model, "weight")
    held = module.sharded(model, _mesh(degrees)).param_bytes_per_device()
    plain = step_cost(Workload.for_config(config, height=512, width=512), parallel).param_bytes
    priced = step_cost(Workload.for_config(config, height=512, width=512, fp8=True), parallel).param_bytes
    assert priced == held < plain
    print(
        f"{name} on {parallel.describe()}: {plain / 1e9:.2f} GB bf16 -> {priced / 1e9:.2f} GB fp8 per device"
    )


def test_the_planner_leaves_pipefusion_out_of_fp8_plans():
    from jaxdit.plan.search import invalid_reasons
    from jaxdit.plan.workload import Workload

    w = Workload.for_config(flux.FluxConfig.preset("flux-dev"), height=512, width=512, fp8=True)
    assert any("without PipeFusion" in r for r in invalid_reasons(w, ParallelConfig(pipefusion=2, ulysses=4)))
    assert not invalid_reasons(w, ParallelConfig(ulysses=8))
