"""HunyuanVideo 1.5's VAE against diffusers' ``AutoencoderKLHunyuanVideo15`` on one device, and its
row-parallel decode / encode on 2 and 4 emulated devices against the one-device run.

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
from jaxdit import hlo_stats
from jaxdit.loading.hunyuan_video15 import load_hunyuan_video15_vae
from jaxdit.mesh import ParallelConfig
from jaxdit.vae import spatial
from jaxdit.vae.hunyuan_video15_vae import HunyuanVideo15VAEConfig
from jaxdit.vae.hunyuan_video15_vae_mesh import HunyuanVideo15MeshVAE

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


# ------------------------------------------------------------------------------------------ row parallel

#: Quick CPU compiles: the model is tiny, compile time dominates.
FAST = {"xla_backend_optimization_level": 0}
#: Latent rows per case: 5 on 2 tiles (3 + 2, one padding row inside the last tile), 5 on 4 (2, 2,
#: 1 + 1 padding, padding only), 6 on 4 (2, 2, 2, padding only: the last real row ends a tile, so the
#: replicated bottom edge must replace the halo the all-padding tile sends).
ROW_CASES = [(2, 5), (4, 5), (4, 6)]


def _mesh(n):
    # Any mesh: the VAE splits rows over all of its devices, whatever the axes.
    return (ParallelConfig(cfg=2) if n == 2 else ParallelConfig(ring=2, ulysses=2)).make_mesh(
        jax.devices()[:n]
    )


@pytest.fixture(scope="module")
def on_mesh(case):
    return HunyuanVideo15MeshVAE(load_hunyuan_video15_vae(case[0]), compiler_options=FAST)


@pytest.fixture(scope="module")
def one_device(on_mesh):
    rng = np.random.default_rng(1)
    cases = {h: rng.standard_normal((1, 4, 2, h, 2)).astype(np.float32) for h in (5, 6)}
    return {h: (z, np.asarray(on_mesh.decode(z))) for h, z in cases.items()}


@pytest.mark.parametrize(("devices", "height"), ROW_CASES)
def test_mesh_decode_equals_one_device(on_mesh, one_device, devices, height):
    z, want = one_device[height]
    mesh = _mesh(devices)
    got = np.asarray(on_mesh.decode(z, mesh))
    assert got.shape == want.shape == (1, 3, 5, 16 * height, 32)
    tol.check(got, want, tol.VAE_TILES, f"decode, {height} latent rows on {devices} devices vs one device")
    # Halo rows and the attention's K/V band only: permutes; the RMS norms are per voxel (no GroupNorm),
    # so no statistic is reduced across the tiles.
    hlo = on_mesh.compiled_decode(z.shape, mesh).as_text()
    assert "collective-permute" in hlo
    for op in ("all-gather(", "all-reduce(", "all-to-all(", "reduce-scatter("):
        assert op not in hlo, op


def _decoder_conv3_inputs(
    cfg: HunyuanVideo15VAEConfig, frames: int, width: int
) -> list[tuple[int, int, int]]:
    """(frames, columns, channels) of the input of every 3x3x3 convolution of the decoder, in order."""
    boc = tuple(reversed(cfg.block_out_channels))
    t, w, c = frames, width, boc[0]
    out = [(t, w, cfg.latent_channels)] + [(t, w, c)] * 4  # conv_in, the mid block's two ResNets
    for i, level in enumerate(boc):
        for j in range(cfg.layers_per_block + 1):
            out += [(t, w, c if j == 0 else level), (t, w, level)]
        c = level
        if i < cfg.spatial_levels:
            out.append((t, w, level))  # the upsampler's convolution, then 2x rows and columns
            w, c = 2 * w, boc[i + 1]
            t = 1 + 2 * (t - 1) if i < cfg.temporal_levels else t  # the first frame stays one frame
    return out + [(t, w, boc[-1])]  # conv_out


def test_mesh_decode_collectives(on_mesh, one_device):
    """Exactly: one halo row each way per 3x3x3 convolution (2 permutes), and 2(P-1) permutes of the
    mid-block attention's K/V band; nothing else (no norm statistics cross a tile)."""
    z, _ = one_device[5]
    devices = 4
    stats = hlo_stats.summarize(on_mesh.compiled_decode(z.shape, _mesh(devices)))
    assert {k for k, v in stats.items() if v["count"] and k != "total"} == {"collective-permute"}
    convs = _decoder_conv3_inputs(HunyuanVideo15VAEConfig(**CONFIG), z.shape[2], z.shape[4])
    rows = spatial.Rows.split(z.shape[3], devices)
    halo = sum(2 * t * w * c * 4 for t, w, c in convs)  # batch 1, fp32, one row up and one down
    band = z.shape[2] * rows.local * z.shape[4] * CONFIG["block_out_channels"][-1] * 4
    assert stats["collective-permute"]["count"] == 2 * len(convs) + 2 * (devices - 1)
    assert stats["collective-permute"]["bytes"] == halo + 2 * (devices - 1) * band


def test_zero_edges_would_be_caught(case, one_device, monkeypatch):
    """The comparison above sees the edge: with the image edge zero-padded on the tiles (what the halo of
    the other VAEs does) the 2-device decode moves by far more than the bound."""
    real = spatial.edge_rows
    monkeypatch.setattr(
        spatial, "edge_rows", lambda band, rows, before: band if rows.tiles > 1 else real(band, rows, before)
    )
    z, want = one_device[5]
    got = np.asarray(
        HunyuanVideo15MeshVAE(load_hunyuan_video15_vae(case[0]), compiler_options=FAST).decode(z, _mesh(2))
    )
    assert np.abs(got - want).max() > 100 * tol.VAE_TILES.allowed(np.abs(want).max())


def test_mesh_encode_equals_one_device(on_mesh):
    # 48 pixel rows on 2 tiles: bands of 32 (a multiple of 16): 32, 16 + 16 padding.
    x = np.random.default_rng(2).uniform(-1, 1, (1, 3, 5, 48, 32)).astype(np.float32)
    want = np.asarray(on_mesh.encode(x))
    got = np.asarray(on_mesh.encode(x, _mesh(2)))
    assert got.shape == want.shape == (1, 4, 2, 3, 2)
    tol.check(got, want, tol.VAE_TILES, "encode, 48 pixel rows on 2 devices vs one device")


def test_mesh_encode_of_a_first_frame_equals_one_device(on_mesh):
    """The image-to-video first frame (one frame, the tiny i2v bucket 48 x 64) on 4 devices: bands of 16
    pixel rows, the last tile all padding (what the i2v pipeline runs)."""
    x = np.random.default_rng(3).uniform(-1, 1, (1, 3, 1, 48, 64)).astype(np.float32)
    want = np.asarray(on_mesh.encode(x))
    got = np.asarray(on_mesh.encode(x, _mesh(4)))
    assert got.shape == want.shape == (1, 4, 1, 3, 4)
    tol.check(got, want, tol.VAE_TILES, "encode, a first frame of 48 pixel rows on 4 devices vs one device")


def test_decode_memory_falls_with_devices(on_mesh):
    """Per-device temporary bytes of the compiled decode (what ``scripts/video_vae_memory.py --vae
    hunyuanvideo1.5`` reports at full size), 8 latent rows."""
    shape = (1, 4, 2, 8, 2)
    temps = {
        n: on_mesh.compiled_decode(shape, None if n == 1 else _mesh(n)).memory_analysis().temp_size_in_bytes
        for n in (1, 2, 4)
    }
    print("per-device temp bytes:", temps)
    assert temps[1] > temps[2] > temps[4]
    assert temps[4] < 0.5 * temps[1]
