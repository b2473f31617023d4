"""Qwen-Image's VAE (diffusers ``AutoencoderKLQwenImage``) read through jaxdit's Wan VAE: the same
modules and keys on single frames, with Qwen-Image's own latent statistics.

A tiny random diffusers ``AutoencoderKLQwenImage`` saved as a pipeline's ``vae/`` folder; its one-frame
decode and encode against diffusers, and the row-parallel decode on 4 devices against one. fp32; bounds
from tests/tolerance.py.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import tolerance as tol
import torch

from converters import vae_wan
from jaxdit.loading.wan import load_wan_vae
from jaxdit.mesh import ParallelConfig

FAST = {"xla_backend_optimization_level": 0}
LATENTS = (1, 16, 1, 5, 7)  # one frame -> an image [1, 3, 1, 40, 56]
MEAN = [0.1 * i - 0.7 for i in range(16)]
STD = [1.0 + 0.1 * i for i in range(16)]


@pytest.fixture(scope="module")
def reference():
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    model = AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=16,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=MEAN,
        latents_std=STD,
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gamma", "bias")):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    pipeline = tmp_path_factory.mktemp("qwen_image_pipeline")
    reference.save_pretrained(pipeline / "vae")
    return pipeline


@pytest.fixture(scope="module")
def vae(folder):
    return load_wan_vae(folder, compiler_options=FAST)  # the pipeline folder: its vae/ is found


@pytest.fixture(scope="module")
def latents():
    return np.random.default_rng(0).standard_normal(LATENTS).astype(np.float32)


def test_config_is_read_from_the_qwen_image_class(folder, vae):
    data = json.loads((folder / "vae" / "config.json").read_text())
    assert data["_class_name"] == "AutoencoderKLQwenImage" and "input_channels" in data
    cfg = vae.config
    assert cfg.latents_mean == tuple(MEAN) and cfg.latents_std == tuple(STD)
    assert (cfg.in_channels, cfg.out_channels, cfg.base_dim, cfg.dim_mult) == (3, 3, 4, (1, 2, 2, 2))
    assert vae_wan.detect(folder).layout == "diffusers"


def test_single_frame_decode_and_encode_match_diffusers(reference, vae, latents):
    with torch.no_grad():
        want = reference.decode(torch.from_numpy(latents)).sample.numpy()
    got = np.asarray(vae.decode(latents))
    assert got.shape == want.shape == (1, 3, 1, 40, 56)
    tol.check(got, want, tol.TORCH_FORWARD, "Qwen-Image VAE decode vs diffusers")
    image = np.random.default_rng(1).uniform(-1, 1, (1, 3, 1, 40, 56)).astype(np.float32)
    with torch.no_grad():
        posterior = reference.encode(torch.from_numpy(image)).latent_dist
    mean, _ = vae.encode(image)
    tol.check(mean, posterior.mean.numpy(), tol.TORCH_FORWARD, "Qwen-Image VAE encode vs diffusers, mean")


def test_row_parallel_decode_equals_one_device(vae, latents):
    mesh = ParallelConfig(ring=2, ulysses=2).make_mesh(jax.devices()[:4])
    got = np.asarray(vae.decode(latents, mesh))
    tol.check(got, np.asarray(vae.decode(latents)), tol.VAE_TILES, "4 devices, 5 latent rows, vs one device")
