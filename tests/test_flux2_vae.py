"""FLUX.2's autoencoder against diffusers' ``AutoencoderKLFlux2`` as ``Flux2Pipeline`` uses it: the
transformer's normalised, packed tokens decoded to pixels, and a reference picture encoded to tokens.

A tiny random model (two levels of 32 / 64 channels, 4 latent channels, so 16 after the 2 x 2 patches)
with random BatchNorm running statistics, saved with ``save_pretrained``. fp32; bounds from
tests/tolerance.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import tolerance as tol
import torch

from converters.errors import CheckpointError
from jaxdit.loading.flux2_vae import load_flux2_vae
from jaxdit.vae.flux2_vae import patchify, unpatchify

ROWS, COLS = 3, 2  # token grid: 6 x 4 latents, 12 x 8 pixels (two levels: 2x down-sampling)
PIXELS_PER_TOKEN = 4


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(0)
    model = AutoencoderKLFlux2(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=4,
    ).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
        model.bn.running_mean.copy_(torch.randn(16, generator=gen))
        model.bn.running_var.copy_(torch.rand(16, generator=gen) * 2 + 0.1)
    folder = tmp_path_factory.mktemp("flux2_vae") / "vae"
    model.save_pretrained(folder)
    return folder, model, load_flux2_vae(folder)


def test_decode_tokens_matches_the_pipeline(case):
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    _, model, ours = case
    tokens = np.random.default_rng(0).standard_normal((2, ROWS * COLS, 16)).astype(np.float32)
    got = np.asarray(ours.decode_tokens(tokens, ROWS, COLS))
    with torch.no_grad():  # the pipeline's decode path, step by step
        t = torch.from_numpy(tokens)
        ids = Flux2Pipeline._prepare_latent_ids(torch.zeros(2, 16, ROWS, COLS))
        z = Flux2Pipeline._unpack_latents_with_ids(t, ids)
        std = torch.sqrt(model.bn.running_var.view(1, -1, 1, 1) + model.config.batch_norm_eps)
        z = Flux2Pipeline._unpatchify_latents(z * std + model.bn.running_mean.view(1, -1, 1, 1))
        want = model.decode(z, return_dict=False)[0].numpy()
    assert got.shape == want.shape == (2, 3, PIXELS_PER_TOKEN * ROWS, PIXELS_PER_TOKEN * COLS)
    tol.check(got, want, tol.TORCH_FORWARD, "FLUX.2 VAE token decode vs diffusers")


def test_encode_tokens_matches_the_pipeline(case):
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    _, model, ours = case
    pixels = (
        np.random.default_rng(1)
        .uniform(-1, 1, (1, 3, PIXELS_PER_TOKEN * ROWS, PIXELS_PER_TOKEN * COLS))
        .astype(np.float32)
    )
    got, rows, cols = ours.encode_tokens(pixels)
    with torch.no_grad():
        pipe = Flux2Pipeline.__new__(Flux2Pipeline)
        object.__setattr__(pipe, "vae", model)  # the only module _encode_vae_image reads
        z = pipe._encode_vae_image(torch.from_numpy(pixels), generator=None)
        want = Flux2Pipeline._pack_latents(z).numpy()
    assert (rows, cols) == (ROWS, COLS)
    tol.check(np.asarray(got), want, tol.TORCH_FORWARD, "FLUX.2 VAE reference encode vs diffusers")


def test_patchify_is_diffusers_and_inverts():
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    z = np.random.default_rng(2).standard_normal((2, 4, 6, 8)).astype(np.float32)
    want = Flux2Pipeline._patchify_latents(torch.from_numpy(z)).numpy()
    assert np.array_equal(np.asarray(patchify(z)), want)
    assert np.array_equal(np.asarray(unpatchify(patchify(z))), z)
    with pytest.raises(ValueError, match="not divisible"):
        patchify(z[:, :, :5])


def test_bad_folders_are_refused(case, tmp_path):
    folder, _, _ = case
    with pytest.raises(CheckpointError, match="not a FLUX.2 autoencoder"):
        load_flux2_vae(tmp_path)
    from safetensors.numpy import load_file, save_file

    sd = load_file(folder / "diffusion_pytorch_model.safetensors")
    bad = tmp_path / "vae"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    save_file(
        {k: v for k, v in sd.items() if k != "bn.running_var"}, bad / "diffusion_pytorch_model.safetensors"
    )
    with pytest.raises(CheckpointError, match="no latent statistics bn.running_var"):
        load_flux2_vae(tmp_path)
    save_file(
        {**sd, "decoder.extra.weight": sd["bn.running_mean"]}, bad / "diffusion_pytorch_model.safetensors"
    )
    with pytest.raises(CheckpointError, match="decoder.extra.weight"):
        load_flux2_vae(tmp_path)
