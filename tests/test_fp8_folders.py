"""A diffusers transformer folder saved with float8 weights loads as the weights it stands for: the
blocks' 2-D weights stored as float8_e4m3fn with one fp32 ``weight_scale`` per output channel (the
per-channel layout FP8 exporters write beside a weight), read as ``value x scale`` exactly, and the forward
within E4M3 rounding of the folder it came from."""

from __future__ import annotations

import json
import shutil

import flux_tiny
import jax.numpy as jnp
import numpy as np

from converters.checkpoint_files import open_checkpoint
from jaxdit.families import load_params
from jaxdit.mesh import single_device_mesh
from jaxdit.models import flux

WEIGHTS = "diffusion_pytorch_model.safetensors"


def _fp8_folder(tmp_path):
    """The tiny FLUX diffusers folder with its blocks' 2-D weights in FP8, scaled per output channel."""
    import torch
    from safetensors.torch import load_file, save_file

    source = flux_tiny.diffusers_folder(True)
    folder = tmp_path / "flux-fp8"
    folder.mkdir()
    shutil.copy(source / "config.json", folder / "config.json")
    out, rounded = {}, {}
    for key, value in load_file(str(source / WEIGHTS)).items():
        if "blocks." in key and key.endswith(".weight") and value.ndim == 2:
            scale = (value.abs().amax(dim=1) / 448.0).clamp(min=1e-12)  # [out]: torch weights are [out, in]
            q = (value / scale[:, None]).to(torch.float8_e4m3fn)
            out[key], out[key[: -len("weight")] + "weight_scale"] = q, scale.float()
            rounded[key] = q.float() * scale[:, None]
        else:
            out[key] = value
    save_file(out, str(folder / WEIGHTS))
    return source, folder, rounded


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_a_diffusers_folder_with_float8_weights_loads_as_the_weights_it_stands_for(tmp_path):
    source, folder, rounded = _fp8_folder(tmp_path)
    assert json.loads((folder / "config.json").read_text())["_class_name"] == "FluxTransformer2DModel"
    files = open_checkpoint(folder)
    assert not any(k.endswith("weight_scale") for k in files)
    for key in list(rounded)[:3]:
        np.testing.assert_array_equal(files.read(key), rounded[key].numpy())  # value x scale, exactly
    mesh, x = single_device_mesh(), flux_tiny.case(True)[0]
    _, model = load_params(folder, mesh, jnp.float32)
    _, original = load_params(source, mesh, jnp.float32)
    out, reference = (np.asarray(flux.sharded(m, mesh)(**x)) for m in (model, original))
    error = _rel(out, reference)
    print(f"diffusers folder with per-channel FP8 weights vs its fp32 source: {error:.2e} relative")
    assert 1e-4 < error < 2**-4  # it was rounded, by less than one E4M3 step
