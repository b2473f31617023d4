"""Wan 2.2 VAE (residual blocks, 2x2 pixel patchify, 48 latent channels at full size): equivalence with
diffusers' AutoencoderKLWan (fp32), row-parallel decode and encode against one device, the converters.

One tiny random diffusers VAE shaped like the released one (``is_residual``, ``patch_size=2``, 12
input/output channels, dim_mult [1, 2, 4, 4], a decoder wider than the encoder; base 4 / decoder base 6,
z_dim 8, one residual block per level, ~310 k parameters; RMS_norm gammas and biases perturbed) is saved
with ``save_pretrained`` and loaded by jaxdit. The latents have 5 rows and the encoded video 80 pixel rows,
which 2, 4 and 8 devices do not divide (the last tiles partly or wholly padding).
"""

import jax
import numpy as np
import pytest
import tolerance as tol
import torch
from flax import nnx

from converters import vae_wan
from converters.errors import CheckpointError, CheckpointKeyError
from jaxdit.loading.wan import load_wan_vae
from jaxdit.mesh import ParallelConfig
from jaxdit.vae.wan_vae import WAN22_LATENTS_MEAN, WanVAEConfig, parameter_shapes

#: Quick CPU compiles: the models are tiny, compile time dominates.
FAST = {"xla_backend_optimization_level": 0}
Z = 8
LATENTS = (1, Z, 3, 5, 4)  # -> video (1, 3, 9, 80, 64)
VIDEO = (1, 3, 9, 80, 64)  # -> latents (1, 8, 3, 5, 4)
MESHES = {2: ParallelConfig(cfg=2), 4: ParallelConfig(ring=2, ulysses=2), 8: ParallelConfig(ulysses=8)}
NO_GATHER = ("all-gather(", "all-reduce(", "all-to-all(", "reduce-scatter(")


@pytest.fixture(scope="module")
def reference():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    model = AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=6,
        z_dim=Z,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[0.1 * i - 0.3 for i in range(Z)],
        latents_std=[0.5 + 0.1 * i for i in range(Z)],
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gamma", "bias")):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("wan22_vae") / "vae"
    reference.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vae(folder):
    return load_wan_vae(folder, compiler_options=FAST)


@pytest.fixture(scope="module")
def decoded(vae):
    z = np.random.default_rng(0).standard_normal(LATENTS).astype(np.float32)
    return z, np.asarray(vae.decode(z))


@pytest.fixture(scope="module")
def encoded(vae):
    x = np.random.default_rng(1).uniform(-1, 1, VIDEO).astype(np.float32)
    return x, tuple(np.asarray(a) for a in vae.encode(x))


def _mesh(n):
    return MESHES[n].make_mesh(jax.devices()[:n])


# ------------------------------------------------------------------------------------------ numerics


def test_config_from_the_folder(vae):
    cfg = vae.config
    assert cfg.is_residual and cfg.patch == 2 and (cfg.base_dim, cfg.decoder_base_dim) == (4, 6)
    assert (cfg.spatial_factor, cfg.temporal_factor, cfg.video_channels) == (16, 4, 3)


def test_decode_matches_diffusers(reference, decoded):
    z, got = decoded
    with torch.no_grad():
        want = reference.decode(torch.from_numpy(z)).sample.numpy()
    assert got.shape == want.shape == (1, 3, 9, 80, 64)
    tol.check(got, want, tol.TORCH_FORWARD, "Wan 2.2 decode vs diffusers")
    assert got.min() >= -1 and got.max() <= 1 and (np.abs(got) == 1).any()  # the clip is exercised


def test_encode_matches_diffusers(reference, encoded):
    x, (mean, logvar) = encoded
    with torch.no_grad():
        posterior = reference.encode(torch.from_numpy(x)).latent_dist
    assert mean.shape == logvar.shape == (1, Z, 3, 5, 4)
    tol.check(mean, posterior.mean.numpy(), tol.TORCH_FORWARD, "Wan 2.2 encode vs diffusers: mean")
    tol.check(logvar, posterior.logvar.numpy(), tol.TORCH_FORWARD, "Wan 2.2 encode vs diffusers: logvar")


def test_latent_normalisation_round_trip(vae, decoded, encoded):
    """normalize_latents is the pipelines' (z - mean) / std; decode_latents undoes it before decoding."""
    cfg = vae.config
    mean = np.asarray(cfg.latents_mean, np.float32).reshape(1, -1, 1, 1, 1)
    std = np.asarray(cfg.latents_std, np.float32).reshape(1, -1, 1, 1, 1)
    _, (latent, _) = encoded
    tol.check(vae.normalize_latents(latent), (latent - mean) / std, tol.ROUNDING, "normalize_latents")
    z, video = decoded
    # The normalisation is undone in fp32 before the same decode: only its rounding differs.
    tol.check(vae.decode_latents((z - mean) / std), video, tol.DECODE_LATENTS, "decode_latents vs decode")


# ------------------------------------------------------------------------------------------ parallel


@pytest.mark.parametrize("n", sorted(MESHES))
def test_parallel_decode_equals_unsharded(vae, decoded, n):
    z, unsharded = decoded
    got = np.asarray(vae.decode(z, _mesh(n)))
    tol.check(got, unsharded, tol.VAE_TILES, f"Wan 2.2 decode, {n} devices, 5 latent rows vs one device")
    hlo = vae.compiled_decode(LATENTS, _mesh(n)).as_text()
    assert "collective-permute" in hlo
    for op in NO_GATHER:
        assert op not in hlo, op


@pytest.mark.parametrize("n", sorted(MESHES))
def test_parallel_encode_equals_unsharded(vae, encoded, n):
    x, (mean, logvar) = encoded
    got_mean, got_logvar = (np.asarray(a) for a in vae.encode(x, _mesh(n)))
    what = f"Wan 2.2 encode, {n} devices, 80 rows vs one device"
    tol.check(got_mean, mean, tol.VAE_TILES, f"{what}: mean")
    tol.check(got_logvar, logvar, tol.VAE_TILES, f"{what}: logvar")
    hlo = vae.compiled_encode(VIDEO, _mesh(n)).as_text()
    assert "collective-permute" in hlo
    for op in NO_GATHER:
        assert op not in hlo, op


def test_memory_falls_with_devices(vae):
    """Per-device temporaries of the programs compiled above (cached: no new compile)."""
    decode = {n: vae.compiled_decode(LATENTS, _mesh(n)).memory_analysis().temp_size_in_bytes for n in MESHES}
    encode = {n: vae.compiled_encode(VIDEO, _mesh(n)).memory_analysis().temp_size_in_bytes for n in MESHES}
    # measured decode {2: 1268712, 4: 914296, 8: 458648}, encode {2: 945256, 4: 642296, 8: 342296}
    print("Wan 2.2 per-device temp bytes: decode", decode, "encode", encode)
    assert decode[2] > decode[4] > decode[8]
    assert encode[2] > encode[4] > encode[8]


# ------------------------------------------------------------------------------------------ converters


def test_full_size_preset():
    """The released VAE: 704.7 M parameters in 196 tensors, as diffusers builds it from the same config."""
    from diffusers import AutoencoderKLWan

    cfg = WanVAEConfig.preset("wan2.2-vae")
    shapes = parameter_shapes(cfg)
    total = sum(int(np.prod(s)) for s in shapes.values())
    with torch.device("meta"):
        model = AutoencoderKLWan(**{k: v for k, v in cfg.to_diffusers().items() if k != "_class_name"})
    assert total == sum(p.numel() for p in model.parameters()) == 704_688_668
    assert len(shapes) == len(model.state_dict()) == 196
    assert (cfg.spatial_factor, cfg.temporal_factor, cfg.z_dim, cfg.video_channels) == (16, 4, 48, 3)
    assert cfg.latents_mean == WAN22_LATENTS_MEAN and len(cfg.latents_std) == 48
    # What diffusers' convert script writes (and 0.42 ignores): clip_output.
    again = WanVAEConfig.from_diffusers({**cfg.to_diffusers(), "clip_output": False})
    assert again == cfg


def _params(vae):
    return {".".join(map(str, p)): np.asarray(v) for p, v in nnx.to_flat_state(vae.state)}


def test_original_pth_round_trip(reference, vae, tmp_path):
    cfg, sd = vae.config, {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    params = vae_wan.diffusers_to_params(cfg, sd)
    path = vae_wan.write_original_pth(cfg, params, tmp_path / "Wan2.2_VAE.pth")
    original = torch.load(path, weights_only=True)
    assert len(original) == len(sd)
    # wan/modules/vae2_2.py: one block per level, an inner list of residual blocks then the resampler.
    assert "encoder.downsamples.1.downsamples.1.time_conv.weight" in original
    assert "decoder.upsamples.0.upsamples.2.resample.1.weight" in original
    assert "decoder.upsamples.2.upsamples.0.shortcut.weight" in original  # 24 -> 12 channels
    assert original["encoder.conv1.weight"].shape == (4, 12, 3, 3, 3)
    # Loaded from the file, and from a folder as Wan's release lays it out: bit-identical parameters.
    torch.save({"shared.weight": torch.zeros(2, 2)}, tmp_path / "models_t5_umt5-xxl-enc-bf16.pth")
    for source in (path, tmp_path):
        loaded = load_wan_vae(source, config=cfg)
        for a, b in zip(jax.tree.leaves(loaded.state), jax.tree.leaves(vae.state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Without a config: the Wan 2.2 preset (residual blocks found) with widths read from the tensors.
    inferred = vae_wan.detect(path).config
    assert inferred.is_residual and inferred.patch_size == 2
    assert (inferred.base_dim, inferred.decoder_base_dim, inferred.z_dim) == (4, 6, Z)
    assert (inferred.in_channels, inferred.out_channels) == (12, 12)


def test_corrupt_original_names_key_and_file(vae, tmp_path):
    state = {k: torch.from_numpy(v) for k, v in _params_as_original(vae).items()}
    key = "decoder.upsamples.1.upsamples.0.residual.2.weight"
    bad = dict(state)
    bad[key] = bad[key][:, :, :2]
    path = tmp_path / "Wan2.2_VAE.pth"
    torch.save(bad, path)
    with pytest.raises(CheckpointError, match=r"upsamples\.1\.upsamples\.0\.residual\.2\.weight") as info:
        load_wan_vae(path, config=vae.config)
    assert str(path) in str(info.value)
    missing = {k: v for k, v in state.items() if k != "encoder.downsamples.2.downsamples.1.resample.1.bias"}
    torch.save(missing, path)
    with pytest.raises(
        CheckpointKeyError, match=r"downsamples\.2\.downsamples\.1\.resample\.1\.bias"
    ) as info:
        load_wan_vae(path, config=vae.config)
    assert str(path) in str(info.value)


def _params_as_original(vae):
    from converters.keymap import invert

    return invert(vae_wan.original_table(vae.config), _params(vae))
