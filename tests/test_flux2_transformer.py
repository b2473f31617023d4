"""FLUX.2's transformer against diffusers' ``Flux2Transformer2DModel``, on one device and on meshes,
with two reference images joined along the sequence as diffusers' pipelines join them.

A tiny random diffusers model (``flux2_tiny.py``) saved with ``save_pretrained`` in shards and loaded
through ``converters/flux2.py``; 5 text tokens (odd: padded on every sequence mesh), a 4 x 6 packed
image and reference grids of 2 x 3 and 3 x 1 tokens at times 10 and 20. fp32; bounds from
tests/tolerance.py, errors printed (``pytest -s``).
"""

from __future__ import annotations

import flux2_tiny as tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
import torch

from converters.errors import CheckpointError
from converters.flux2 import CHECKPOINTS, bfl_table, config_from_bfl_shapes, detect, diffusers_to_params
from converters.keymap import invert
from converters.safetensors_io import write_safetensors
from jaxdit.loading.params import load_params
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux2
from jaxdit.models.flux2_config import Flux2Config, image_ids, reference_ids, text_ids
from jaxdit.models.layers import rope_angles

TEXT, GRID, REFS = 5, (4, 6), ((2, 3), (3, 1))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, torch model, inputs with references, diffusers' output)."""
    folder = tmp_path_factory.mktemp("flux2") / "transformer"
    model = tiny.transformer()
    model.save_pretrained(folder, max_shard_size="40KB")
    x = tiny.inputs(2, TEXT, GRID, REFS)
    return folder, model, x, tiny.reference(model, x)


def _forward(folder, pc: ParallelConfig, x, dtype=None):
    mesh = pc.make_mesh(jax.devices()[: pc.num_devices])
    model = load_params(folder, mesh, dtype, checkpoints=CHECKPOINTS)
    return np.asarray(flux2.sharded(model, mesh)(**x), np.float32)


@pytest.fixture(scope="module")
def one_device(case):
    folder, _, x, _ = case
    return _forward(folder, ParallelConfig(), x)


def test_matches_diffusers_with_reference_images(case, one_device):
    _, _, x, want = case
    assert one_device.shape == want.shape == (2, GRID[0] * GRID[1], 16)
    tol.check(one_device, want, tol.TORCH_FORWARD, "FLUX.2 transformer with references vs diffusers")


def test_references_change_the_prediction(case, one_device):
    """The reference tokens are attended to (a forward without them differs), and only through
    attention: the prediction keeps the denoised tokens' shape."""
    folder, model, x, _ = case
    plain = {k: v for k, v in x.items() if not k.startswith("reference")}
    got = _forward(folder, ParallelConfig(), plain)
    tol.check(got, tiny.reference(model, plain), tol.TORCH_FORWARD, "FLUX.2 without references vs diffusers")
    assert np.abs(got - one_device).max() > 1e-3


def test_text_key_mask_is_dropping_the_masked_tokens(case, one_device):
    """An optional text mask (diffusers' FLUX.2 pipelines pass none) makes the masked tokens no key of
    any attention: the same as diffusers run on the prompt cut to its real tokens (their ids are the
    first ones, so nothing else changes)."""
    folder, model, x, _ = case
    lengths = [TEXT, 3]
    mask = np.arange(TEXT)[None] < np.asarray(lengths)[:, None]
    got = _forward(folder, ParallelConfig(ulysses=2), {**x, "encoder_attention_mask": mask})
    for i, n in enumerate(lengths):
        one = {
            k: (v[i : i + 1] if np.ndim(v) and k not in ("img_ids", "txt_ids", "reference_ids") else v)
            for k, v in x.items()
        }
        one = {**one, "encoder_hidden_states": one["encoder_hidden_states"][:, :n], "txt_ids": text_ids(n)}
        want = tiny.reference(model, one)
        tol.check(got[i : i + 1], want, tol.TORCH_FORWARD, f"masked prompt {i} vs cut")
    assert tol.max_error(one_device[1:], want) > 1e-3  # unmasked, the two tokens do matter


@pytest.mark.parametrize(
    "pc",
    [ParallelConfig(ulysses=2, ring=2), ParallelConfig(tensor=2, ulysses=2), ParallelConfig(cfg=2, ring=2)],
    ids=lambda pc: pc.describe(),
)
def test_meshes_match_one_device(case, one_device, pc):
    folder, _, x, _ = case
    got = _forward(folder, pc, x)
    tol.check(got, one_device, tol.SHARDED, f"{pc.describe()} vs one device")


def test_klein_without_guidance_embedding(tmp_path):
    """klein's transformer has no guidance embedder: it runs with guidance=None and refuses a scale."""
    model = tiny.transformer(seed=1, guidance_embeds=False)
    model.save_pretrained(tmp_path / "transformer")
    x = tiny.inputs(1, TEXT, (3, 2), REFS[:1], guidance=False, seed=1)
    got = _forward(tmp_path / "transformer", ParallelConfig(), x)
    tol.check(got, tiny.reference(model, x), tol.TORCH_FORWARD, "FLUX.2 klein vs diffusers")
    mesh = ParallelConfig().make_mesh(jax.devices()[:1])
    params = load_params(tmp_path / "transformer", mesh, checkpoints=CHECKPOINTS)
    with pytest.raises(ValueError, match="no guidance embedding"):
        flux2.sharded(params, mesh)(**x, guidance=np.ones(1, np.float32))


def test_rope_ids_are_diffusers(case):
    """Our 4-axis ids are the pipeline's, and jaxdit's angles give diffusers' ``Flux2PosEmbed``."""
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    _, model, _, _ = case
    latents = torch.zeros(1, 16, *GRID)
    assert np.array_equal(Flux2Pipeline._prepare_latent_ids(latents)[0].numpy(), image_ids(*GRID))
    assert np.array_equal(Flux2Pipeline._prepare_text_ids(torch.zeros(1, TEXT, 8))[0].numpy(), text_ids(TEXT))
    refs = [torch.zeros(1, 16, r, c) for r, c in REFS]
    assert np.array_equal(Flux2Pipeline._prepare_image_ids(refs)[0].numpy(), reference_ids(list(REFS)))
    ids = np.concatenate([text_ids(TEXT), image_ids(*GRID), reference_ids(list(REFS))])
    cos, sin = model.pos_embed(torch.from_numpy(ids))
    angles = np.asarray(rope_angles(jnp.asarray(ids), tiny.CONFIG["axes_dims_rope"], 2000.0))
    # diffusers repeats each angle for the two members of its rotated pair.
    np.testing.assert_allclose(np.repeat(np.cos(angles), 2, axis=-1), cos.numpy(), atol=2e-6)
    np.testing.assert_allclose(np.repeat(np.sin(angles), 2, axis=-1), sin.numpy(), atol=2e-6)


def test_bfl_single_file_reads_like_the_folder(case, tmp_path):
    """A BFL file made from the diffusers weights by diffusers' own single-file converter run backwards:
    the file our BFL table writes converts back (by diffusers) to the saved state dict, and loads to the
    same parameters as the folder."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    folder, model, _, _ = case
    cfg = Flux2Config(**tiny.CONFIG)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    bfl = invert(bfl_table(cfg), diffusers_to_params(cfg, sd))
    back = convert_flux2_transformer_checkpoint_to_diffusers({k: torch.from_numpy(v) for k, v in bfl.items()})
    assert sorted(back) == sorted(sd) and all(np.array_equal(back[k].numpy(), sd[k]) for k in sd)
    path = write_safetensors(
        tmp_path / "flux2.safetensors", {f"model.diffusion_model.{k}": v for k, v in bfl.items()}
    )
    with pytest.raises(CheckpointError, match="head_dim is 16: the RoPE axes split"):
        detect(path)  # only head_dim 128's split is FLUX.2's known one
    opened = detect(path, cfg)
    assert (opened.layout, opened.prefix) == ("bfl", "model.diffusion_model.")
    assert config_from_bfl_shapes(
        {k: v.shape for k, v in bfl.items()}, axes_dims_rope=cfg.axes_dims_rope
    ) == Flux2Config.from_diffusers(folder / "config.json")
    mesh = ParallelConfig().make_mesh(jax.devices()[:1])
    a = load_params(path, mesh, checkpoints=CHECKPOINTS, config=cfg)
    b = load_params(folder, mesh, checkpoints=CHECKPOINTS)
    for (pa, va), (pb, vb) in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b), strict=True
    ):
        assert pa == pb and np.array_equal(np.asarray(va), np.asarray(vb)), pa


def test_bad_checkpoints_are_refused(case, tmp_path):
    folder, model, _, _ = case
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    cfg = Flux2Config(**tiny.CONFIG)
    extra = {**sd, "transformer_blocks.0.attn.extra.weight": sd["proj_out.weight"]}
    for bad, match in (
        (extra, r"attn\.extra.*not used"),
        (
            {k: v for k, v in sd.items() if k != "single_stream_modulation.linear.weight"},
            "single_stream_modulation",
        ),
    ):
        path = write_safetensors(tmp_path / "diffusion_pytorch_model.safetensors", bad)
        (tmp_path / "config.json").write_text((folder / "config.json").read_text())
        with pytest.raises(CheckpointError, match=match):
            detect(tmp_path, cfg).resolve(flux2.parameter_shapes(cfg))
        path.unlink()
    with pytest.raises(CheckpointError, match="not a FLUX.2 transformer"):
        detect(write_safetensors(tmp_path / "loose.safetensors", sd))  # diffusers keys need their folder
    with pytest.raises(ValueError, match="axes_dims_rope"):
        Flux2Config(**{**tiny.CONFIG, "axes_dims_rope": (4, 4, 4, 2)})


def test_full_size_presets_are_abstract():
    """The presets build as abstract models (no weights) with the published widths."""
    for name, (heads, double, single) in {
        "flux2-dev": (48, 8, 48),
        "flux2-klein-4b": (24, 5, 20),
        "flux2-klein-9b": (32, 8, 24),
    }.items():
        cfg = Flux2Config.preset(name)
        shapes = flux2.parameter_shapes(cfg)
        assert cfg.num_heads == heads
        assert shapes["double_blocks.img_mlp.gate.kernel"] == (double, cfg.hidden_size, 3 * cfg.hidden_size)
        assert shapes["single_blocks.out_attn.kernel"][0] == single
