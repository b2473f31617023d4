"""Z-Image's transformer against diffusers' ``ZImageTransformer2DModel``, on one device and on meshes.

A tiny random diffusers model (``z_image_tiny.py``) saved with ``save_pretrained`` in shards and loaded
through ``converters/z_image.py``. Four prompts of 5, 40, 32 and 1 tokens: padded (learnt pad tokens)
to 32, 64, 32 and 32, so the batch mixes caption lengths under a key mask; a 4 x 6 patch image (24
tokens, padded to 32 with the image pad token); ring3 pads both groups over the shards. fp32; bounds
from tests/tolerance.py, errors printed (``pytest -s``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
import z_image_tiny as tiny

from converters.errors import CheckpointError
from converters.z_image import CHECKPOINTS, detect
from jaxdit.loading.params import load_params
from jaxdit.mesh import ParallelConfig
from jaxdit.models import z_image
from jaxdit.models.z_image_config import ZImageConfig
from jaxdit.models.z_image_tokens import sequence_inputs, unpack

ROWS, COLS = 4, 6
LENGTHS = [5, 40, 32, 1]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, inputs, diffusers' output)."""
    folder = tmp_path_factory.mktemp("z_image") / "transformer"
    model = tiny.transformer()
    model.save_pretrained(folder, max_shard_size="40KB")
    latents, caps, t = tiny.inputs(LENGTHS, ROWS, COLS)
    return folder, (latents, caps, t), tiny.reference(model, latents, caps, t)


def _forward(folder, pc: ParallelConfig, x, dtype=None):
    latents, caps, t = x
    mesh = pc.make_mesh(jax.devices()[: pc.num_devices])
    model = load_params(folder, mesh, dtype, checkpoints=CHECKPOINTS)
    inputs = sequence_inputs(latents, caps, model.config)
    out = z_image.sharded(model, mesh)(**inputs, timestep=t)
    c, h, w = latents.shape[1:]
    return np.asarray(unpack(np.asarray(out, np.float32), c, h, w, model.config.patch_size))


@pytest.fixture(scope="module")
def one_device(case):
    folder, x, _ = case
    return _forward(folder, ParallelConfig(), x)


def test_matches_diffusers_with_prompts_of_different_lengths(case, one_device):
    """The timestep enters as sin / cos of t x 1000, where fp32 exp / sin / cos of XLA and PyTorch differ
    by an ulp (the cause FLUX-dev's guidance embedding has its bound for); the next test removes it."""
    _, x, want = case
    assert one_device.shape == want.shape == x[0].shape
    tol.check(one_device, want, tol.TORCH_FORWARD_GUIDANCE_EMBED, "Z-Image transformer vs diffusers")


def test_matches_diffusers_given_its_timestep_features(case, monkeypatch):
    """With diffusers' own sinusoid features fed in, the rest of the forward is within TORCH_FORWARD."""
    import torch
    from diffusers.models.transformers.transformer_z_image import TimestepEmbedder

    folder, x, want = case
    t = x[2]
    feats = TimestepEmbedder.timestep_embedding(torch.from_numpy(t) * 1000.0, 256).numpy()
    monkeypatch.setattr(z_image, "time_features", lambda timestep, scale: jnp.asarray(feats))
    got = _forward(folder, ParallelConfig(), x)
    tol.check(got, want, tol.TORCH_FORWARD, "Z-Image transformer vs diffusers, diffusers' sinusoid")


def test_each_prompt_is_its_own_length(case):
    """A 5-token prompt alone (no key mask) gives what diffusers gives for it in the batch with a
    40-token one: the batch padding is masked, not attended (unmasked it moves the output by ~1)."""
    folder, (latents, caps, t), want = case
    alone = _forward(folder, ParallelConfig(), (latents[:1], caps[:1], t[:1]))
    tol.check(alone, want[:1], tol.TORCH_FORWARD_GUIDANCE_EMBED, "prompt alone vs diffusers' batch")


@pytest.mark.parametrize(
    "pc",
    [
        ParallelConfig(ring=2, ulysses=2),
        ParallelConfig(ulysses=2, tensor=2),
        ParallelConfig(ring=3),
    ],
    ids=lambda pc: pc.describe(),
)
def test_meshes_match_one_device(case, one_device, pc):
    folder, x, _ = case
    got = _forward(folder, pc, x)
    tol.check(got, one_device, tol.SHARDED, f"{pc.describe()} vs one device")


def test_thirty_heads_refuse_ulysses_four_with_the_degrees_that_fit():
    model = z_image.abstract_model(ZImageConfig.preset("z-image-turbo"))
    mesh = ParallelConfig(ulysses=4).make_mesh(jax.devices()[:4])
    with pytest.raises(
        ValueError, match=r"30 heads cannot be split over ulysses=4.*1, 2, 3, 5, 6, 10, 15, 30"
    ):
        z_image.sharded(model, mesh)


def test_config_round_trips_and_refuses_omni(case):
    folder, _, _ = case
    cfg = detect(folder).config
    assert cfg == ZImageConfig.from_json(cfg.to_json())
    assert (cfg.dim, cfg.n_heads, cfg.n_layers, cfg.n_refiner_layers) == (64, 4, 2, 1)
    with pytest.raises(ValueError, match="Omni"):
        ZImageConfig.from_diffusers({**tiny.CONFIG, "siglip_feat_dim": 8})


def test_a_missing_tensor_is_named(tmp_path):
    from converters.safetensors_write import write_safetensors

    state = {k: v.numpy() for k, v in tiny.transformer().state_dict().items()}
    state.pop("layers.1.feed_forward.w2.weight")
    write_safetensors(tmp_path / "t.safetensors", state)
    assert CHECKPOINTS.detect(tmp_path / "t.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.1\.feed_forward\.w2\.weight"):
        load_params(
            tmp_path / "t.safetensors",
            ParallelConfig().make_mesh(jax.devices()[:1]),
            checkpoints=CHECKPOINTS,
            config=ZImageConfig.from_diffusers(tiny.CONFIG),
        )
