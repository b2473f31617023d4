"""FLUX's AutoencoderKL: equivalence with diffusers' PyTorch model, both checkpoint layouts, strictness.

Tiny random diffusers ``AutoencoderKL``s (several configs, with and without quant convs and mid
attention) are saved as diffusers folders, loaded with ``FluxVAE.from_folder`` and compared with
diffusers' ``decode`` / ``encode`` in fp32 (tests/tolerance.py TORCH_FORWARD). The BFL layout is written
from the same weights through the inverted BFL key table and must load identical parameters.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
import torch
from diffusers import AutoencoderKL as TorchAutoencoderKL
from flax import nnx

from converters.errors import CheckpointError
from converters.keymap import StateDict, resolve
from converters.safetensors_io import open_checkpoint, write_safetensors
from converters.vae_kl import (
    bfl_table,
    detect,
    diffusers_table,
    diffusers_to_params,
    infer_config,
    write_bfl,
)
from jaxdit.loading.vae import load_flux_vae
from jaxdit.vae.autoencoder_kl import FluxVAE, VAEConfig, num_parameters, parameter_shapes

FAST = {"xla_backend_optimization_level": 0}

CONFIGS = {
    # FLUX-like: no quant convs, mid attention, 2 levels.
    "flux_like": dict(block_out_channels=(8, 16), norm_num_groups=4, latent_channels=4, layers_per_block=1),
    # SD-like: quant convs, 3 levels, 2 blocks per level, shortcut convs in the decoder.
    "quant_convs": dict(
        block_out_channels=(8, 16, 16),
        norm_num_groups=4,
        latent_channels=4,
        layers_per_block=2,
        use_quant_conv=True,
        use_post_quant_conv=True,
    ),
    # No mid attention, only the post-quant conv, 8 groups.
    "no_attention": dict(
        block_out_channels=(8, 16),
        norm_num_groups=8,
        latent_channels=2,
        layers_per_block=1,
        use_quant_conv=False,
        use_post_quant_conv=True,
        mid_block_add_attention=False,
    ),
}


def _torch_vae(name: str, seed: int = 0) -> TorchAutoencoderKL:
    kw = dict(CONFIGS[name])
    n = len(kw["block_out_channels"])
    kw.setdefault("use_quant_conv", False)
    kw.setdefault("use_post_quant_conv", False)
    torch.manual_seed(seed)
    model = TorchAutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        **kw,
    ).eval()
    with torch.no_grad():  # norms away from (1, 0), biases away from 0: every parameter matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    model = _torch_vae(request.param)
    folder = tmp_path_factory.mktemp(request.param) / "vae"
    model.save_pretrained(folder, safe_serialization=True)
    return request.param, model, folder


def _flat(vae: FluxVAE) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(vae.state)}


def test_decode_and_encode_match_diffusers(case):
    name, model, folder = case
    vae = load_flux_vae(folder, compiler_options=FAST)
    assert vae.config.block_out_channels == tuple(CONFIGS[name]["block_out_channels"])
    assert vae.config.scaling_factor == 0.3611 and vae.config.shift_factor == 0.1159
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2, vae.config.latent_channels, 5, 3, generator=g)  # odd sizes on purpose
    f = vae.config.downsample_factor
    x = torch.rand(2, 3, 3 * f + 3, 2 * f + 1, generator=g) * 2 - 1  # odd: floor at every level
    with torch.no_grad():
        ref = model.decode(z).sample.numpy()
        dist = model.encode(x).latent_dist
    out = np.asarray(vae.decode(jnp.asarray(z.numpy())))
    tol.check(out, ref, tol.TORCH_FORWARD, f"{name}: decode")
    mean, logvar = vae.encode(jnp.asarray(x.numpy()))
    tol.check(mean, dist.mean.numpy(), tol.TORCH_FORWARD, f"{name}: encode, mean")
    tol.check(logvar, dist.logvar.numpy(), tol.TORCH_FORWARD, f"{name}: encode, logvar")

    # The pipelines' entry point: z/scaling + shift, NHWC, clipped.
    images = np.asarray(vae.decode_latents(jnp.asarray(z.numpy()) * 0.3611 - 0.3611 * 0.1159))
    assert images.shape == (2, 5 * f, 3 * f, 3)
    tol.check(
        images, np.clip(np.transpose(ref, (0, 2, 3, 1)), -1, 1), tol.TORCH_FORWARD, f"{name}: decode_latents"
    )
    assert images.min() >= -1 and images.max() <= 1


def test_bfl_layout_round_trip(case, tmp_path):
    name, model, folder = case
    cfg = VAEConfig.from_diffusers(json.loads((folder / "config.json").read_text()))
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    path = write_bfl(cfg, state, tmp_path / "ae.safetensors")
    keys = set(open_checkpoint(path).keys())
    assert "encoder.down.0.block.0.conv1.weight" in keys
    assert ("decoder.mid.attn_1.q.weight" in keys) == cfg.mid_block_add_attention
    # up.i is indexed by resolution: diffusers' first decoding level is BFL's last.
    n = cfg.levels
    assert f"decoder.up.{n - 1}.block.{cfg.layers_per_block}.conv2.weight" in keys
    if cfg.mid_block_add_attention:
        assert open_checkpoint(path).shape("encoder.mid.attn_1.q.weight")[2:] == (1, 1)
    # GroupNorm's group count is not in the weights: pass the config (the rest is inferred and checked).
    inferred = infer_config(open_checkpoint(path), "bfl", norm_num_groups=cfg.norm_num_groups)
    assert (
        dataclasses.replace(inferred, scaling_factor=cfg.scaling_factor, shift_factor=cfg.shift_factor) == cfg
    )
    with pytest.raises(CheckpointError, match="pass config="):
        detect(path)  # BFL's 32 groups do not divide these channels
    a = _flat(load_flux_vae(folder))
    b = _flat(load_flux_vae(path, config=cfg))
    c = _flat(load_flux_vae(folder.parent))  # a pipeline folder holding vae/
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        np.testing.assert_array_equal(a[k], c[k], err_msg=k)


def test_tables_cover_full_size_flux_ae():
    cfg = VAEConfig.preset("flux")
    with torch.device("meta"):
        ref = TorchAutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            latent_channels=16,
            norm_num_groups=32,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
    sd = ref.state_dict()
    assert set(diffusers_table(cfg).source_keys()) == set(sd)
    # BFL's ae.safetensors holds 244 tensors (checked against black-forest-labs/flux
    # src/flux/modules/autoencoder.py instantiated with the same channels).
    assert len(bfl_table(cfg).source_keys()) == len(sd) == 244
    assert num_parameters(cfg) == sum(p.numel() for p in ref.parameters())
    assert round(num_parameters(cfg) / 1e6, 1) == 83.8
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    resolve(diffusers_table(cfg), _ShapeOnly(shapes), parameter_shapes(cfg))  # every shape agrees


class _ShapeOnly(StateDict):
    """A state dict of zero-stride arrays: shapes without memory."""

    def __init__(self, shapes):
        super().__init__({k: np.broadcast_to(np.zeros((), np.float32), s) for k, s in shapes.items()})


# ----------------------------------------------------------------------------------------- corruption


@pytest.fixture(scope="module")
def tiny_state():
    model = _torch_vae("flux_like")
    cfg = VAEConfig.from_diffusers(dict(model.config))
    return cfg, {k: v.numpy() for k, v in model.state_dict().items()}


def _folder(tmp_path, cfg_model_config, tensors):
    folder = tmp_path / "vae"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg_model_config))
    write_safetensors(folder / "diffusion_pytorch_model.safetensors", tensors)
    return folder


def _config_json():
    kw = dict(
        CONFIGS["flux_like"], _class_name="AutoencoderKL", use_quant_conv=False, use_post_quant_conv=False
    )
    kw["block_out_channels"] = list(kw["block_out_channels"])
    return kw


@pytest.mark.parametrize("damage", ["missing", "extra", "misshaped", "conv_rank"])
def test_corrupt_diffusers_checkpoint(tiny_state, tmp_path, damage):
    _, state = tiny_state
    state = dict(state)
    key = "decoder.up_blocks.1.resnets.0.conv1.weight"
    if damage == "missing":
        del state[key]
    elif damage == "extra":
        state["decoder.up_blocks.1.resnets.0.conv3.weight"] = state[key]
    elif damage == "misshaped":
        state[key] = state[key][:, :-1]
    else:
        state[key] = state[key][:, :, 0]
    folder = _folder(tmp_path, _config_json(), state)
    with pytest.raises(CheckpointError) as e:
        load_flux_vae(folder)
    msg = str(e.value)
    assert ("conv3" if damage == "extra" else key) in msg
    assert "diffusion_pytorch_model.safetensors" in msg


def test_corrupt_bfl_checkpoint(tiny_state, tmp_path):
    cfg, state = tiny_state
    path = write_bfl(cfg, state, tmp_path / "ae.safetensors")
    tensors = {k: open_checkpoint(path).read(k) for k in open_checkpoint(path)}
    tensors["decoder.mid.attn_1.k.weight"] = np.zeros((16, 16, 3, 3), np.float32)  # not a 1x1 conv
    bad = write_safetensors(tmp_path / "bad.safetensors", tensors)
    with pytest.raises(
        CheckpointError,
        match=r"decoder\.mid\.attn_1\.k\.weight.*bad\.safetensors|bad\.safetensors.*decoder\.mid\.attn_1\.k\.weight",
    ):
        load_flux_vae(bad, config=cfg)
    del tensors["decoder.mid.attn_1.k.weight"]
    bad = write_safetensors(tmp_path / "bad2.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"decoder\.mid\.attn_1\.k\.weight"):
        load_flux_vae(bad, config=cfg)


def test_not_a_vae(tmp_path):
    path = write_safetensors(tmp_path / "x.safetensors", {"foo": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError, match="not an AutoencoderKL"):
        load_flux_vae(path)
    with pytest.raises(CheckpointError, match="no such file"):
        load_flux_vae(tmp_path / "nope")


def test_diffusers_to_params_and_config_checks(tiny_state):
    cfg, state = tiny_state
    params = diffusers_to_params(cfg, state)
    assert params["decoder.conv_in.kernel"].shape == (3, 3, 4, 16)  # HWIO
    assert params["decoder.mid.attn.q.kernel"].shape == (16, 16)
    np.testing.assert_array_equal(
        params["decoder.mid.attn.q.kernel"], state["decoder.mid_block.attentions.0.to_q.weight"].T
    )
    with pytest.raises(ValueError, match="only UpDecoderBlock2D"):
        VAEConfig.from_diffusers({"up_block_types": ["AttnUpDecoderBlock2D"], "block_out_channels": [32]})
    with pytest.raises(ValueError, match="norm_num_groups"):
        VAEConfig(block_out_channels=(8, 12), norm_num_groups=8)
    assert jax.tree.leaves(FluxVAE.abstract().state)[0].dtype == jnp.bfloat16


def test_config_keys_left_out_take_diffusers_defaults_not_fluxs():
    """A config.json that omits the quant convs and scaling gets what diffusers' AutoencoderKL would
    build (SD's VAE: quant convs, 0.18215, no shift), not FLUX's values."""
    from diffusers import AutoencoderKL

    sparse = {"block_out_channels": [8, 16], "norm_num_groups": 4, "latent_channels": 4}
    cfg = VAEConfig.from_diffusers(sparse)
    reference = AutoencoderKL(**sparse).config
    assert cfg.use_quant_conv == reference.use_quant_conv is True
    assert cfg.use_post_quant_conv == reference.use_post_quant_conv is True
    assert cfg.scaling_factor == reference.scaling_factor == 0.18215
    assert cfg.shift_factor == 0.0 and reference.shift_factor is None
