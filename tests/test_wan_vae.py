"""Wan 2.1 VAE: equivalence with diffusers' AutoencoderKLWan (fp32), the converters, row-parallel decoding.

One tiny random diffusers VAE (base_dim 4, dim_mult [1, 1, 1, 1], one residual block per level, ~22 k
parameters; RMS_norm gammas and biases perturbed so they are not the identity) is saved once and loaded
by jaxdit. The latents have 13 rows, which 2, 4 and 8 devices do not divide (7, 4 and 2 rows per tile,
the last tiles partly or wholly padding).
"""

import json
import shutil

import jax
import numpy as np
import pytest
import tolerance as tol
import torch

from converters import vae_wan
from converters.errors import CheckpointError, CheckpointKeyError
from converters.safetensors_io import open_checkpoint, write_safetensors
from jaxdit.loading.wan import load_wan_vae
from jaxdit.mesh import ParallelConfig
from jaxdit.vae.wan_vae import WanVAEConfig, parameter_shapes

#: Quick CPU compiles: the models are tiny, compile time dominates.
FAST = {"xla_backend_optimization_level": 0}
LATENTS = (1, 16, 3, 13, 4)  # -> video (1, 3, 9, 104, 32)
#: Meshes of several shapes: the decode uses all of a mesh's devices, whatever its axes.
MESHES = {2: ParallelConfig(cfg=2), 4: ParallelConfig(ring=2, ulysses=2), 8: ParallelConfig(ulysses=8)}


@pytest.fixture(scope="module")
def reference():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    model = AutoencoderKLWan(
        base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gamma", "bias")):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("wan_vae") / "vae"
    reference.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vae(folder):
    return load_wan_vae(folder, compiler_options=FAST)


@pytest.fixture(scope="module")
def latents():
    return np.random.default_rng(0).standard_normal(LATENTS).astype(np.float32)


@pytest.fixture(scope="module")
def unsharded(vae, latents):
    return np.asarray(vae.decode(latents))


def _state_dict(model):
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------ numerics


def test_decode_matches_diffusers(reference, latents, unsharded):
    with torch.no_grad():
        want = reference.decode(torch.from_numpy(latents)).sample.numpy()
    assert unsharded.shape == want.shape == (1, 3, 9, 104, 32)
    tol.check(unsharded, want, tol.TORCH_FORWARD, "decode vs diffusers")
    assert unsharded.min() >= -1 and unsharded.max() <= 1


def test_widening_levels_match_diffusers(tmp_path):
    """dim_mult [1, 2, 2, 2] (base 4): the levels change width, so the residual blocks' 1x1 shortcut
    convs and the narrowing upsamplers run (the fixture model's constant widths never do)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(3)
    model = AutoencoderKLWan(
        base_dim=4, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gamma", "bias")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "vae")
    vae = load_wan_vae(tmp_path / "vae", compiler_options=FAST)
    z = np.random.default_rng(1).standard_normal((1, 16, 2, 3, 4)).astype(np.float32)
    video = np.random.default_rng(2).uniform(-1, 1, (1, 3, 5, 24, 32)).astype(np.float32)
    with torch.no_grad():
        want_video = model.decode(torch.from_numpy(z)).sample.numpy()
        posterior = model.encode(torch.from_numpy(video)).latent_dist
    tol.check(vae.decode(z), want_video, tol.TORCH_FORWARD, "widening levels vs diffusers: decode")
    mean, logvar = vae.encode(video)
    tol.check(mean, posterior.mean.numpy(), tol.TORCH_FORWARD, "widening levels vs diffusers: encode, mean")
    tol.check(logvar, posterior.logvar.numpy(), tol.TORCH_FORWARD, "widening levels: encode, logvar")


def test_decode_latents_undoes_the_normalization(vae, latents, unsharded):
    mean = np.asarray(vae.config.latents_mean, np.float32).reshape(1, -1, 1, 1, 1)
    std = np.asarray(vae.config.latents_std, np.float32).reshape(1, -1, 1, 1, 1)
    got = np.asarray(vae.decode_latents((latents - mean) / std))
    # The normalisation is undone in fp32 before the same decode: only its rounding differs.
    tol.check(got, unsharded, tol.DECODE_LATENTS, "decode_latents vs decode")


def test_encode_matches_diffusers(reference, vae):
    x = np.random.default_rng(1).uniform(-1, 1, (1, 3, 9, 32, 32)).astype(np.float32)
    with torch.no_grad():
        posterior = reference.encode(torch.from_numpy(x)).latent_dist
    mean, logvar = (np.asarray(a) for a in vae.encode(x))
    assert mean.shape == logvar.shape == (1, 16, 3, 4, 4)
    tol.check(mean, posterior.mean.numpy(), tol.TORCH_FORWARD, "encode vs diffusers, mean")
    tol.check(logvar, posterior.logvar.numpy(), tol.TORCH_FORWARD, "encode vs diffusers, logvar")


# ------------------------------------------------------------------------------------------ parallel


@pytest.mark.parametrize("n", sorted(MESHES))
def test_parallel_decode_equals_unsharded(vae, latents, unsharded, n):
    mesh = MESHES[n].make_mesh(jax.devices()[:n])
    got = np.asarray(vae.decode(latents, mesh))
    tol.check(got, unsharded, tol.VAE_TILES, f"{n} devices, 13 latent rows, vs one device")
    # Halo rows and ring attention only: no all-gather or all-reduce of activations.
    hlo = vae.compiled_decode(LATENTS, mesh).as_text()
    assert "collective-permute" in hlo
    for op in ("all-gather(", "all-reduce(", "all-to-all(", "reduce-scatter("):
        assert op not in hlo, op


def test_activation_memory_falls_with_devices(vae):
    temps = {}
    for n in (1, *sorted(MESHES)):
        mesh = None if n == 1 else MESHES[n].make_mesh(jax.devices()[:n])
        temps[n] = vae.compiled_decode(LATENTS, mesh).memory_analysis().temp_size_in_bytes
    print("per-device temp bytes:", temps)  # measured {1: 1950984, 2: 1177080, 4: 681480, 8: 330792}
    counts = sorted(temps)
    assert all(temps[a] > temps[b] for a, b in zip(counts, counts[1:], strict=False))
    assert temps[8] < 0.35 * temps[1]


#: A video whose 5 latent rows (40 pixel rows) neither 2 nor 4 devices divide: bands of 24 / 16 pixel
#: rows (multiples of 8, so all three stride-2 levels halve them), the last tiles partly or wholly padding.
VIDEO = (1, 3, 9, 40, 16)


@pytest.fixture(scope="module")
def encoded(vae):
    x = np.random.default_rng(2).uniform(-1, 1, VIDEO).astype(np.float32)
    return x, tuple(np.asarray(a) for a in vae.encode(x))


@pytest.mark.parametrize("n", [2, 4])
def test_parallel_encode_equals_unsharded(vae, encoded, n):
    x, (mean, logvar) = encoded
    mesh = MESHES[n].make_mesh(jax.devices()[:n])
    got_mean, got_logvar = (np.asarray(a) for a in vae.encode(x, mesh))
    assert got_mean.shape == got_logvar.shape == mean.shape == (1, 16, 3, 5, 2)
    tol.check(got_mean, mean, tol.VAE_TILES, f"encode, {n} devices, 40 rows, vs one device: mean")
    tol.check(got_logvar, logvar, tol.VAE_TILES, f"encode, {n} devices, 40 rows, vs one device: logvar")
    # Halo rows and ring attention only (the encoder has no GroupNorm): permutes, no all-gather.
    hlo = vae.compiled_encode(VIDEO, mesh).as_text()
    assert "collective-permute" in hlo
    for op in ("all-gather(", "all-reduce(", "all-to-all(", "reduce-scatter("):
        assert op not in hlo, op


def test_encode_memory_falls_with_devices(vae, encoded):
    temps = {}
    for n in (1, 2, 4):
        mesh = None if n == 1 else MESHES[n].make_mesh(jax.devices()[:n])
        temps[n] = vae.compiled_encode(VIDEO, mesh).memory_analysis().temp_size_in_bytes
    print("encode per-device temp bytes:", temps)  # measured {1: 355288, 2: 216520, 4: 184280}
    assert temps[1] > temps[2] > temps[4]


# ------------------------------------------------------------------------------------------ converters


def test_config_and_preset():
    preset = WanVAEConfig.preset("wan2.1-vae")
    total = sum(int(np.prod(s)) for s in parameter_shapes(preset).values())
    # The parameter count of Wan-AI's Wan2.1_VAE.pth.
    assert round(total / 1e6, 1) == 126.9
    assert (preset.temporal_factor, preset.spatial_factor) == (4, 8)
    # Wan 2.2's residual VAE (tests/test_wan22_vae.py) and encoder attention (tests/test_wan_vae_configs.py)
    # are supported; a configuration diffusers refuses is refused, with the numbers.
    assert WanVAEConfig.from_diffusers({"_class_name": "AutoencoderKLWan", "is_residual": True}).is_residual
    with pytest.raises(ValueError, match="4 channels x 1 .* into 8 groups"):
        WanVAEConfig(base_dim=4, dim_mult=(1, 2), is_residual=True)


def test_original_pth_round_trip(reference, vae, tmp_path):

    cfg, sd = vae.config, _state_dict(reference)
    params = vae_wan.diffusers_to_params(cfg, sd)
    path = vae_wan.write_original_pth(cfg, params, tmp_path / "Wan2.1_VAE.pth")
    original = {k: v.numpy() for k, v in torch.load(path, weights_only=True).items()}
    assert len(original) == len(sd)
    assert original["conv1.weight"].shape == (32, 32, 1, 1, 1)  # the quant conv
    assert original["decoder.middle.1.norm.gamma"].shape == (4, 1, 1)
    assert "decoder.upsamples.2.resample.1.weight" in original  # level 0: 2 residual blocks, then this
    assert "encoder.downsamples.3.time_conv.weight" in original
    # Loaded by jaxdit (the file, or a folder like Wan's release: the transformer's config.json and the
    # text encoder's .pth beside it): bit-identical parameters.
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "WanModel", "dim": 1536}))
    torch.save({"shared.weight": torch.zeros(2, 2)}, tmp_path / "models_t5_umt5-xxl-enc-bf16.pth")
    for source in (path, tmp_path):
        loaded = load_wan_vae(source, config=cfg)
        assert jax.tree.structure(loaded.state) == jax.tree.structure(vae.state)
        for a, b in zip(jax.tree.leaves(loaded.state), jax.tree.leaves(vae.state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Without a config, widths come from the tensors and the rest from the Wan 2.1 preset.
    assert vae_wan.detect(path).config.base_dim == 4


def test_original_table_agrees_with_diffusers_conversion_at_full_size():
    # diffusers' convert_wan_vae_to_diffusers hard-codes the released architecture's block numbering,
    # so it is checked at full size, on small stand-in arrays (one distinct value per parameter).
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from converters.keymap import invert

    cfg = WanVAEConfig.preset()
    params = {
        path: np.full([min(d, 2) for d in shape], i, np.float32)
        for i, (path, shape) in enumerate(sorted(parameter_shapes(cfg).items()))
    }
    want = invert(vae_wan.diffusers_table(cfg), params)
    original = invert(vae_wan.original_table(cfg), params)
    back = convert_wan_vae_to_diffusers({k: torch.from_numpy(v) for k, v in original.items()})
    assert set(back) == set(want)
    for key, value in want.items():
        np.testing.assert_array_equal(back[key].numpy(), value, err_msg=key)


class _NotATensor:
    pass


def test_pth_is_read_weights_only(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"decoder.conv1.weight": _NotATensor()}, path)
    with pytest.raises(CheckpointError, match="evil.pth"):
        vae_wan.read_pth(path)


def _copy(folder, tmp_path, edit):
    """A copy of the diffusers folder with its tensors edited by ``edit(dict) -> dict``."""
    dst = tmp_path / "vae"
    shutil.copytree(folder, dst)
    file = dst / "diffusion_pytorch_model.safetensors"
    ckpt = open_checkpoint(file)
    tensors = edit({k: ckpt.read(k) for k in ckpt})
    ckpt.close()
    write_safetensors(file, tensors)
    return dst, file


def test_corrupt_checkpoints_name_key_and_file(folder, vae, tmp_path):
    key = "decoder.up_blocks.1.resnets.0.conv2.weight"

    def missing(t):
        return {k: v for k, v in t.items() if k != key}

    def extra(t):
        return {**t, "decoder.up_blocks.1.resnets.0.conv3.weight": t[key]}

    def misshaped(t):
        return {**t, key: t[key][:, :, :2]}

    for name, edit, error in (("missing", missing, CheckpointKeyError), ("extra", extra, CheckpointError)):
        dst, file = _copy(folder, tmp_path / name, edit)
        with pytest.raises(error) as info:
            load_wan_vae(dst)
        assert ("conv3" if name == "extra" else key) in str(info.value)
        assert str(file) in str(info.value)

    dst, file = _copy(folder, tmp_path / "misshaped", misshaped)
    with pytest.raises(CheckpointError, match=r"conv2\.weight.*\(4, 4, 2, 3, 3\)") as info:
        load_wan_vae(dst)
    assert str(file) in str(info.value)

    # A config that does not match the tensors: the first mismatching tensor is named.
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="encoder.conv_in.weight"):
        load_wan_vae(folder, config={**config, "base_dim": 8})

    # The original layout: a .pth with a tensor missing names it and the file.
    good = vae_wan.write_original_pth(vae.config, _params(vae), tmp_path / "good.pth")
    state = torch.load(good, weights_only=True)
    state.pop("decoder.head.2.bias")
    path = tmp_path / "Wan2.1_VAE.pth"
    torch.save(state, path)
    with pytest.raises(CheckpointKeyError, match=r"decoder\.head\.2\.bias") as info:
        load_wan_vae(path, config=vae.config)
    assert str(path) in str(info.value)


def _params(vae):
    from flax import nnx

    return {".".join(map(str, p)): np.asarray(v) for p, v in nnx.to_flat_state(vae.state)}
