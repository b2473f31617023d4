"""Patch-parallel VAE decoding (``jaxdit.vae.spatial``): exact, only halo permutes + norm all-reduces
(+ Ring attention's K/V permutes at the lowest resolution), and per-device memory falling with the
device count.

Latent heights are chosen so that the device count does not divide them and some tiles hold few or no
real rows (5 rows on 4 tiles: 2, 2, 1 + 1 padding, 2 padding; 5 rows on 8 tiles: three tiles of padding
only); that is allowed and exact, there is no minimum height.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
from jax.sharding import Mesh

from jaxdit import hlo_stats
from jaxdit.vae import spatial
from jaxdit.vae.autoencoder_kl import FluxVAE, VAEConfig

FAST = {"xla_backend_optimization_level": 0}
CFG = VAEConfig(block_out_channels=(8, 16), norm_num_groups=4, latent_channels=4, layers_per_block=1)
WIDTH = 3  # latent columns


def _mesh(n: int) -> Mesh:
    # Any mesh: the VAE splits rows over all of its devices (2-D here on purpose).
    devs = np.array(jax.devices()[:n])
    return Mesh(devs.reshape(2, n // 2) if n > 2 else devs, ("a", "b")[: 2 if n > 2 else 1])


@pytest.fixture(scope="module")
def vae():
    return FluxVAE.random(CFG, seed=0, compiler_options=FAST)


def _latents(h: int) -> jax.Array:
    return jax.random.normal(jax.random.key(h), (2, CFG.latent_channels, h, WIDTH), jnp.float32)


@pytest.fixture(scope="module")
def reference(vae):
    return {h: np.asarray(vae.decode(_latents(h))) for h in (5, 7)}


@pytest.mark.parametrize(("devices", "height"), [(2, 7), (4, 5), (8, 5)])
def test_sharded_decode_equals_unsharded(vae, reference, devices, height):
    rows = spatial.Rows.split(height, devices)
    empty = [t for t in range(devices) if rows.valid_rows_of(t) == 0]
    out = np.asarray(vae.decode(_latents(height), mesh=_mesh(devices)))
    ref = reference[height]
    assert out.shape == ref.shape == (2, 3, 2 * height, 2 * WIDTH)
    what = f"{devices} devices, {height} latent rows (tiles without real rows: {empty})"
    tol.check(out, ref, tol.VAE_TILES, what)
    assert np.abs(ref).max() > 0.1  # not a trivially constant image


def test_sharded_encode_equals_unsharded(vae):
    # 10 pixel rows on 4 tiles: bands of 4 (even, for the stride-2 conv): 4, 4, 2 + 2 padding, padding.
    x = jax.random.uniform(jax.random.key(1), (1, 3, 10, 6), minval=-1, maxval=1)
    mean, logvar = vae.encode(x)
    mean4, logvar4 = vae.encode(x, mesh=_mesh(4))
    assert mean.shape == (1, CFG.latent_channels, 5, 3)
    tol.check(mean4, mean, tol.VAE_TILES, "sharded encode, mean")
    tol.check(logvar4, logvar, tol.VAE_TILES, "sharded encode, logvar")


def _conv3_inputs(cfg: VAEConfig, h: int, w: int) -> list[tuple[int, int]]:
    """(columns, channels) of the input of every 3x3 conv of the decoder, in order."""
    ch = tuple(reversed(cfg.block_out_channels))
    out = [(w, cfg.latent_channels)] + [(w, ch[0])] * 4  # conv_in, mid block's two ResNets
    for k, c in enumerate(ch):
        for j in range(cfg.layers_per_block + 1):
            out += [(w, ch[max(k - 1, 0)] if j == 0 else c), (w, c)]
        if k < len(ch) - 1:
            w *= 2
            out.append((w, c))  # the conv after upsampling
    return out + [(w, ch[-1])]  # conv_out


def _norms(cfg: VAEConfig) -> int:
    return 5 + cfg.levels * (cfg.layers_per_block + 1) * 2 + 1


@pytest.mark.parametrize(("devices", "height"), [(4, 5)])
def test_sharded_decode_collectives(vae, devices, height):
    """Exactly: 2 halo permutes per 3x3 conv (one row each way), 2(P-1) Ring permutes of the K/V band,
    two [B, groups] fp32 all-reduces per GroupNorm. No all-gather, no all-to-all."""
    compiled = vae.lower_decode((2, CFG.latent_channels, height, WIDTH), _mesh(devices)).compile()
    stats = hlo_stats.summarize(compiled)
    used = {k for k, v in stats.items() if v["count"] and k != "total"}
    assert used == {"collective-permute", "all-reduce"}, used
    rows = spatial.Rows.split(height, devices)
    convs = _conv3_inputs(CFG, height, WIDTH)
    halo_bytes = sum(2 * 2 * w * c * 4 for w, c in convs)  # batch 2, fp32, one row up and one down
    kv_band = 2 * rows.local * WIDTH * CFG.block_out_channels[-1] * 4
    assert stats["collective-permute"]["count"] == 2 * len(convs) + 2 * (devices - 1)
    assert stats["collective-permute"]["bytes"] == halo_bytes + 2 * (devices - 1) * kv_band
    assert stats["all-reduce"]["count"] == 2 * _norms(CFG)
    for c in hlo_stats.collectives(compiled):
        if c.kind == "all-reduce":
            assert c.bytes_per_device == 2 * CFG.norm_num_groups * 4, c  # [B, G] fp32
        else:  # one row of a band, or Ring attention's K/V band at the latent resolution
            shape = c.operand_shapes[0].dims
            assert shape[1] == 1 or c.bytes_per_device == kv_band, c
    print(
        f"{devices} devices: {stats['collective-permute']['count']} permutes "
        f"({stats['collective-permute']['bytes']} B), {stats['all-reduce']['count']} all-reduces "
        f"({stats['all-reduce']['bytes']} B)"
    )


def test_activation_memory_falls_with_devices():
    """Compiled temp bytes per device for a decode from abstract parameters (nothing allocated).

    A smaller AE than FLUX's keeps the compiles cheap; ``scripts/vae_memory.py`` measures the real one
    (FLUX AE, 1024x1024: temp 3586 / 1794 / 898 / 450 MiB per device on 1 / 2 / 4 / 8 devices, fp32).
    The size is one where the convolutions' activations dominate, as they do at FLUX's sizes: Ring
    attention's hops are unrolled, and on a small image with few channels XLA's schedule can keep several
    hops' score tiles alive at once (latent 64x64 here: 4 devices need more temp than 2).
    """
    cfg = VAEConfig(block_out_channels=(32, 64), norm_num_groups=8, latent_channels=4, layers_per_block=1)
    abstract = FluxVAE.abstract(cfg, jnp.float32, compiler_options=FAST)
    temp = {}
    for n in (1, 2, 4, 8):
        mesh = None if n == 1 else _mesh(n)
        compiled = abstract.lower_decode((1, 4, 32, 32), mesh).compile()
        temp[n] = hlo_stats.memory_per_device(compiled)["temp"]
    print("temp bytes per device:", temp)
    for n in (2, 4, 8):
        # 1/n of the activations, plus a little for halos and the K/V band in flight.
        assert temp[n] < 1.15 * temp[1] / n, (n, temp)


def test_rows_layout_rules():
    rows = spatial.Rows.split(5, 4)
    assert (rows.local, rows.padded, [rows.valid_rows_of(t) for t in range(4)]) == (2, 8, [2, 2, 1, 0])
    up = rows.upsampled()
    assert (up.rows, up.local) == (10, 4)
    enc = spatial.Rows.split(10, 4, multiple=2)
    assert (enc.local, enc.downsampled().rows, enc.downsampled().local) == (4, 5, 2)
    with pytest.raises(ValueError, match="even number of rows per tile"):
        spatial.Rows.split(9, 3).downsampled()
    with pytest.raises(ValueError, match="halo"):
        spatial.halo(jnp.zeros((1, 1, 2, 1)), spatial.Rows.split(2, 2), 2, 2)


def _tiled(fn, rows: spatial.Rows, *arrays):
    """Run ``fn(*local bands)`` over the tiles of ``rows`` (arrays given in the global, padded view)."""
    mesh = spatial.tile_mesh(jax.devices()[: rows.tiles])
    spec = spatial.row_spec(arrays[0].ndim)
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(arrays), out_specs=spec, check_vma=False)
    )(*(spatial.pad_rows(a, rows) for a in arrays))


@pytest.mark.parametrize(
    ("height", "tiles", "reach"),
    # no padding; padding inside the last real tile; the last real row ends a tile and the next tile is
    # all padding (its halo must not be read); two tiles of padding only; a two-row halo
    [(8, 2, 1), (7, 2, 1), (6, 4, 1), (5, 8, 1), (9, 3, 2)],
)
def test_edge_halo_replicates_the_image_edge(height, tiles, reach):
    """halo(mode="edge"): every real row's window equals the window of the edge-padded global image."""
    rows = spatial.Rows.split(height, tiles)
    x = jax.random.normal(jax.random.key(height), (2, height, 3, 4))
    band = rows.local + 2 * reach
    # Each tile returns its band with the halo: the global result is the tiles' bands one after another.
    got = _tiled(lambda xl: spatial.halo(xl, rows, reach, reach, mode="edge"), rows, x)
    got = np.asarray(got).reshape(2, tiles, band, 3, 4)
    padded = np.pad(np.asarray(x), ((0, 0), (reach, reach), (0, 0), (0, 0)), mode="edge")
    for t in range(tiles):
        for i in range(rows.valid_rows_of(t)):
            g = t * rows.local + i  # global row; its window is padded rows g .. g + 2 * reach
            np.testing.assert_array_equal(got[:, t, i : i + 2 * reach + 1], padded[:, g : g + 2 * reach + 1])
    with pytest.raises(ValueError, match="'zero' or 'edge'"):
        spatial.halo(x, spatial.Rows.split(height, 1), 1, 1, mode="reflect")


def test_frame_causal_attention_over_tiles():
    """Frame-causal attention on 4 tiles (5 rows: the last tiles partly or wholly padding) against the
    full masked softmax on one device: a query of frame i sees every real pixel of frames 0..i."""
    b, t, h, w, c = 1, 3, 5, 2, 8
    q, k, v = (jax.random.normal(jax.random.key(i), (b, t, h, w, c)) for i in range(3))
    frame = np.repeat(np.arange(t), h * w)
    s = jnp.einsum("bqc,bkc->bqk", q.reshape(b, -1, c), k.reshape(b, -1, c)) / np.sqrt(c)
    s = jnp.where(frame[:, None] >= frame[None, :], s, -jnp.inf)
    want = (jax.nn.softmax(s, -1) @ v.reshape(b, -1, c)).reshape(q.shape)
    for tiles in (1, 4):
        rows = spatial.Rows.split(h, tiles)
        got = _tiled(lambda *a, rows=rows: spatial.frame_causal_attention(*a, rows), rows, q, k, v)
        tol.check(spatial.unpad_rows(got, rows), want, tol.KERNEL, f"frame-causal attention, {tiles} tiles")
