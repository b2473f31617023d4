"""HunyuanVideo 1.5's VAE against diffusers' ``AutoencoderKLHunyuanVideo15`` on one device.

A tiny random diffusers VAE (4 latent channels, widths 8-16, the real 16x spatial / 4x temporal
compression, so every kind of level runs: spatial-only and spatio-temporal down/up samplers, the
first-frame paths, the causal mid-block attention over 2 latent frames), saved with ``save_pretrained``
and read through ``converters/vae_hunyuan_video15.py``. fp32; bounds from tests/tolerance.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import tolerance as tol
import torch
from flax import nnx

from converters.errors import CheckpointError
from converters.safetensors_io import write_safetensors
from jaxdit.loading.hunyuan_video15 import load_hunyuan_video15_vae
from jaxdit.vae.hunyuan_video15_vae import HunyuanVideo15VAEConfig

CONFIG = dict(latent_channels=4, block_out_channels=(8, 8, 16, 16, 16), layers_per_block=1)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(**CONFIG).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in vae.parameters():  # gammas off one, biases off zero
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    folder = tmp_path_factory.mktemp("hunyuan_video15_vae") / "vae"
    vae.save_pretrained(folder)
    return folder, vae


def test_decode_and_encode_match_diffusers(case):
    folder, vae = case
    model = load_hunyuan_video15_vae(folder)
    rng = np.random.default_rng(0)
    z = rng.standard_normal((1, 4, 2, 3, 2)).astype(np.float32)  # 2 latent frames -> 5 frames of 48 x 32
    x = rng.uniform(-1, 1, (1, 3, 5, 32, 48)).astype(np.float32)
    with torch.no_grad():
        want_dec = vae.decode(torch.from_numpy(z)).sample.numpy()
        want_enc = vae.encode(torch.from_numpy(x)).latent_dist.mode().numpy()
    graphdef, state = nnx.split(model)
    got_dec = jax.jit(lambda s, z: nnx.merge(graphdef, s).decode(z))(state, z)
    got_enc = jax.jit(lambda s, x: nnx.merge(graphdef, s).encode(x))(state, x)
    assert got_dec.shape == want_dec.shape == (1, 3, 5, 48, 32)
    assert got_enc.shape == want_enc.shape == (1, 4, 2, 2, 3)
    tol.check(got_dec, want_dec, tol.TORCH_FORWARD, "HunyuanVideo 1.5 VAE decode vs diffusers")
    tol.check(got_enc, want_enc, tol.TORCH_FORWARD, "HunyuanVideo 1.5 VAE encode (mode) vs diffusers")


def test_bad_checkpoints_and_inputs_are_refused(case, tmp_path):
    folder, vae = case
    sd = {k: v.numpy() for k, v in vae.state_dict().items()}
    bad = tmp_path / "vae"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    write_safetensors(
        bad / "diffusion_pytorch_model.safetensors", {**sd, "decoder.extra": sd["decoder.norm_out.gamma"]}
    )
    with pytest.raises(CheckpointError, match=r"decoder\.extra.*not used"):
        load_hunyuan_video15_vae(bad)
    with pytest.raises(CheckpointError, match="not a diffusers AutoencoderKLHunyuanVideo15 folder"):
        load_hunyuan_video15_vae(folder.parent.parent)
    cfg = HunyuanVideo15VAEConfig(**CONFIG)
    with pytest.raises(ValueError, match="1 \\+ k \\* 4 frames"):
        cfg.latent_frames(6)
