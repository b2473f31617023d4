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


def _original_layout(state: dict) -> dict:
    """A diffusers state dict written in the original single-file layout (ComfyUI's): fused qkv, the
    original names, the unused ``norm_final``, under ``model.diffusion_model.``."""
    out = {}
    for key, value in state.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            parts = [state[key.replace("to_q", n)] for n in ("to_q", "to_k", "to_v")]
            key, value = key.replace("to_q", "qkv"), np.concatenate(parts)
        key = key.replace("all_final_layer.2-1.", "final_layer.").replace(
            "all_x_embedder.2-1.", "x_embedder."
        )
        key = key.replace(".attention.to_out.0.", ".attention.out.")
        key = key.replace(".attention.norm_q.", ".attention.q_norm.").replace(
            ".attention.norm_k.", ".attention.k_norm."
        )
        out["model.diffusion_model." + key] = value
    out["model.diffusion_model.norm_final.weight"] = np.ones(tiny.CONFIG["dim"], np.float32)
    return out


def test_original_single_file_loads_the_same_parameters(case, tmp_path):
    """ComfyUI's single file: what diffusers' own converter turns into this model's state dict, read into
    exactly the parameters the diffusers folder gives (config inferred from the shapes but the RoPE
    split, which a file does not carry)."""
    import torch
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    from converters.safetensors_write import write_safetensors

    folder, _, _ = case
    state = {k: v.numpy() for k, v in tiny.transformer().state_dict().items()}
    original = _original_layout(state)
    back = convert_z_image_transformer_checkpoint_to_diffusers(
        {k: torch.from_numpy(v) for k, v in original.items()}
    )
    assert set(back) == set(state) and all(np.array_equal(back[k].numpy(), state[k]) for k in state)
    write_safetensors(tmp_path / "z_image_turbo.safetensors", original)
    opened = detect(tmp_path / "z_image_turbo.safetensors", ZImageConfig.from_diffusers(tiny.CONFIG))
    assert (opened.layout, opened.prefix) == ("original", "model.diffusion_model.")
    got = _params(tmp_path / "z_image_turbo.safetensors", opened.config)
    want = _params(folder)
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in got)


def _params(path, config=None) -> dict:
    from flax import nnx

    from jaxdit.loading.params import flat_path

    mesh = ParallelConfig().make_mesh(jax.devices()[:1])
    model = load_params(path, mesh, checkpoints=CHECKPOINTS, config=config)
    return {flat_path(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def test_jaxdit_convert_round_trips(case, tmp_path):
    """``jaxdit convert`` of the diffusers folder: an orbax folder of family z-image holding the same
    parameters."""
    from jaxdit import families

    folder, _, _ = case
    assert families.detect_family(folder).name == "z-image"
    out = families.convert_checkpoint(folder, tmp_path / "zimage-orbax")
    assert families.detect_family(out).name == "z-image"
    got, want = _params(out), _params(folder)
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in got)
