"""The Wan VAE accepts what diffusers' AutoencoderKLWan accepts, and matches it there (fp32).

- diffusers' own test model (``tests/models/autoencoders/test_models_autoencoder_wan.py``): ``base_dim=3``,
  odd widths the Wan 2.1 upsamplers floor-halve (3 -> 1 channel);
- everything else the constructor takes: a decoder base width of its own without residual blocks,
  encoder attention (``attn_scales``), a temporal factor of 2, and a ``temperal_downsample`` longer than
  the levels (the encoder reads its head, the decoder the head of the reversed list: here they differ,
  time 2x down and 4x up, as in diffusers);
- configurations diffusers refuses (at construction or at encode/decode) fail with a message that names
  the numbers, before anything is compiled.
"""

import jax
import numpy as np
import pytest
import tolerance as tol
import torch

from jaxdit.loading.wan import load_wan_vae
from jaxdit.mesh import ParallelConfig
from jaxdit.vae.wan_vae import WanVAE, WanVAEConfig, abstract_model

FAST = {"xla_backend_optimization_level": 0}


def _diffusers(tmp_path, seed, **config):
    """A random diffusers VAE (gammas and biases perturbed), saved, and jaxdit's load of the folder."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    model = AutoencoderKLWan(**config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gamma", "bias")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "vae")
    return model, load_wan_vae(tmp_path / "vae", compiler_options=FAST)


def _check_against_diffusers(model, vae, z, video, what):
    """Decode and encode against diffusers (``tolerance.TORCH_FORWARD``); returns jaxdit's mean, logvar."""
    with torch.no_grad():
        want_video = model.decode(torch.from_numpy(z)).sample.numpy()
        posterior = model.encode(torch.from_numpy(video)).latent_dist
    got_video = np.asarray(vae.decode(z))
    mean, logvar = (np.asarray(a) for a in vae.encode(video))
    assert got_video.shape == want_video.shape and mean.shape == tuple(posterior.mean.shape)
    tol.check(got_video, want_video, tol.TORCH_FORWARD, f"{what} vs diffusers: decode")
    tol.check(mean, posterior.mean.numpy(), tol.TORCH_FORWARD, f"{what} vs diffusers: encode, mean")
    tol.check(logvar, posterior.logvar.numpy(), tol.TORCH_FORWARD, f"{what} vs diffusers: encode, logvar")
    return mean, logvar


def test_diffusers_own_test_model_base_dim_3(tmp_path):
    model, vae = _diffusers(
        tmp_path, 0, base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )  # fmt: skip
    assert vae.config.decoder_dims() == [3, 3, 3, 3, 3]  # upsamplers: 3 -> 1 channel, next level 1 -> 3
    rng = np.random.default_rng(0)
    z = rng.standard_normal((2, 16, 3, 2, 2)).astype(np.float32)
    video = rng.standard_normal((2, 3, 9, 16, 16)).astype(np.float32)  # diffusers' test input
    _check_against_diffusers(model, vae, z, video, "base_dim=3")


def test_other_configurations_diffusers_accepts(tmp_path, monkeypatch):
    # diffusers' WanEncoder3d calls every layer with feat_cache/feat_idx, which its WanAttentionBlock does
    # not take, so its encode raises whenever attn_scales is set; the block's own math is what Wan's
    # wan/modules/vae.py runs. Dropping the two arguments makes the reference runnable.
    from diffusers.models.autoencoders import autoencoder_kl_wan

    attention = autoencoder_kl_wan.WanAttentionBlock.forward
    monkeypatch.setattr(
        autoencoder_kl_wan.WanAttentionBlock,
        "forward",
        lambda self, x, feat_cache=None, feat_idx=None: attention(self, x),
    )
    model, vae = _diffusers(
        tmp_path, 1, base_dim=3, decoder_base_dim=5, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        attn_scales=[0.5], temperal_downsample=[False, True, False, True],
    )  # fmt: skip
    cfg = vae.config
    assert (cfg.temporal_factor, cfg.decoder_temporal_factor) == (2, 4)
    assert sum(type(layer).__name__ == "Attention" for layer in vae.model.encoder.down) == 1
    rng = np.random.default_rng(1)
    z = rng.standard_normal((1, 4, 3, 3, 4)).astype(np.float32)  # -> 1 + 4*2 = 9 frames
    video = rng.uniform(-1, 1, (1, 3, 9, 40, 32)).astype(np.float32)  # -> 1 + 2*2 = 5 latent frames
    mean, logvar = _check_against_diffusers(model, vae, z, video, "other configs")
    # The encoder attention at half resolution, row-parallel: 20 rows on 4 tiles of 8 (the last padding).
    mesh = ParallelConfig(ring=2, ulysses=2).make_mesh(jax.devices()[:4])
    got_mean, got_logvar = (np.asarray(a) for a in vae.encode(video, mesh))
    tol.check(got_mean, mean, tol.VAE_TILES, "other configs, encode on 4 devices vs one: mean")
    tol.check(got_logvar, logvar, tol.VAE_TILES, "other configs, encode on 4 devices vs one: logvar")
    # diffusers keeps its 16 default latents_mean for z_dim=4; the normalisation is where it fails.
    with pytest.raises(ValueError, match="latents_mean has 16 values for z_dim=4"):
        vae.decode_latents(z)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(base_dim=4, dim_mult=(1, 2), is_residual=True), r"encoder level 1: 4 channels x 1 .* 8 groups"),
        # time 8x down at encoder level 2, no time up at the mirrored decoder level (a longer list)
        (
            dict(base_dim=4, dim_mult=(1, 1, 8, 8), is_residual=True, temperal_downsample=(0, 0, 1, 0)),
            r"decoder level 2: 4 channels x 4 .* 32 input channels",
        ),
        (dict(base_dim=1, dim_mult=(1, 1, 1, 1)), "1 channel.* halve it to 0"),
        (dict(temperal_downsample=(True,)), "at least 3 entries"),
        (dict(dim_mult=()), "dim_mult"),
    ],
)
def test_configurations_diffusers_refuses(config, message):
    with pytest.raises(ValueError, match=message):
        WanVAEConfig(**config)


def test_inputs_diffusers_cannot_run_fail_before_compiling():
    tiny = dict(base_dim=4, z_dim=4, latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4, num_res_blocks=1)
    eight = WanVAE(abstract_model(WanVAEConfig(**tiny, temperal_downsample=(True, True, True))))
    with pytest.raises(ValueError, match="compresses time 8x .* only single frames"):
        eight.encode(np.zeros((1, 3, 5, 16, 16), np.float32))
    narrow = WanVAE(abstract_model(WanVAEConfig(**{**tiny, "num_res_blocks": 0})))
    with pytest.raises(ValueError, match="num_res_blocks=0 with encoder widths"):
        narrow.encode(np.zeros((1, 3, 1, 16, 16), np.float32))
    patched = WanVAE(abstract_model(WanVAEConfig(**tiny, patch_size=2, in_channels=10, out_channels=10)))
    with pytest.raises(ValueError, match="in_channels=10 is not a whole number of 2x2 patches"):
        patched.encode(np.zeros((1, 2, 1, 16, 16), np.float32))
    with pytest.raises(ValueError, match="out_channels=10 do not unpatchify"):
        patched.decode(np.zeros((1, 4, 1, 2, 2), np.float32))
    assert not eight._compiled and not narrow._compiled and not patched._compiled
