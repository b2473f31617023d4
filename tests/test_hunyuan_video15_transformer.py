"""HunyuanVideo 1.5's transformer against diffusers' ``HunyuanVideo15Transformer3DModel``, on one device
and on meshes.

A tiny random diffusers model (``hunyuan_video15_tiny.py``) saved with ``save_pretrained`` in shards and
loaded through ``converters/hunyuan_video15.py``. Two samples: prompts of 5 and 2 real tokens of 5, glyph
prompts of 0 and 2 of 3 (diffusers reorders real tokens first; here they are masked in place), a 3 x 4 x 6
latent in 2 x 2 patches (18 video tokens). Text-to-video (zero image tokens: masked, one token stands in)
and image-to-video (3 image tokens). Every mesh pads every group. fp32; bounds from tests/tolerance.py,
errors printed (``pytest -s``).
"""

from __future__ import annotations

import hunyuan_video15_tiny as tiny
import jax
import numpy as np
import pytest
import tolerance as tol

from converters.errors import CheckpointError
from converters.hunyuan_video15 import CHECKPOINTS
from converters.safetensors_io import write_safetensors
from jaxdit.loading.params import load_params
from jaxdit.mesh import ParallelConfig, single_device_mesh
from jaxdit.models import hunyuan_video15 as hv
from jaxdit.models.hunyuan_video15_config import HunyuanVideo15Config

FRAMES, HEIGHT, WIDTH = 3, 4, 6
LENGTHS, GLYPH_LENGTHS = [5, 2], [0, 2]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, torch model, {kind: (inputs, diffusers' output)})."""
    folder = tmp_path_factory.mktemp("hunyuan_video15") / "transformer"
    model = tiny.transformer()
    model.save_pretrained(folder, max_shard_size="2MB")
    runs = {}
    for kind, image in (("t2v", 0), ("i2v", 3)):
        x = tiny.inputs(FRAMES, HEIGHT, WIDTH, LENGTHS, GLYPH_LENGTHS, image=image)
        runs[kind] = (x, tiny.reference(model, x))
    return folder, model, runs


def _forward(folder, pc: ParallelConfig, x):
    mesh = pc.make_mesh(jax.devices()[: pc.num_devices])
    model = load_params(folder, mesh, checkpoints=CHECKPOINTS)
    cfg = model.config
    args = {k: v for k, v in x.items() if k != "timestep"}
    out = hv.sharded(model, mesh)(**hv.forward_inputs(**args, config=cfg), timestep=x["timestep"])
    grid = hv.latent_grid(x["hidden_states"].shape, cfg)
    return np.asarray(hv.unpatchify(np.asarray(out, np.float32), grid, cfg))


@pytest.fixture(scope="module")
def one_device(case):
    folder, _, runs = case
    return {kind: _forward(folder, ParallelConfig(), x) for kind, (x, _) in runs.items()}


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_matches_diffusers(case, one_device, kind):
    _, _, runs = case
    want = runs[kind][1]
    assert one_device[kind].shape == want.shape == (2, 2, FRAMES, HEIGHT, WIDTH)
    tol.check(one_device[kind], want, tol.TORCH_FORWARD, f"HunyuanVideo 1.5 {kind} vs diffusers")


@pytest.mark.parametrize(
    "pc",
    [
        ParallelConfig(ring=2, ulysses=2),
        ParallelConfig(cfg=2, ulysses=2),
        ParallelConfig(ulysses=2, tensor=2),
    ],
    ids=lambda pc: pc.describe(),
)
def test_meshes_match_one_device(case, one_device, pc):
    folder, _, runs = case
    got = _forward(folder, pc, runs["i2v"][0])
    tol.check(got, one_device["i2v"], tol.SHARDED, f"{pc.describe()} vs one device")


def test_bad_checkpoints_and_inputs_are_refused(case, tmp_path):
    folder, model, runs = case
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    extra = tmp_path / "transformer"
    extra.mkdir()
    (extra / "config.json").write_text((folder / "config.json").read_text())
    write_safetensors(
        extra / "diffusion_pytorch_model.safetensors",
        {**sd, "transformer_blocks.0.attn.extra": sd["cond_type_embed.weight"]},
    )
    with pytest.raises(CheckpointError, match=r"attn\.extra.*not used"):
        load_params(extra, single_device_mesh(), checkpoints=CHECKPOINTS)
    with pytest.raises(ValueError, match="qk_norm 'layer_norm'"):
        HunyuanVideo15Config.from_diffusers({"qk_norm": "layer_norm"})
    x = {k: v for k, v in runs["t2v"][0].items() if k != "timestep"}
    cfg = HunyuanVideo15Config(**tiny.CONFIG)
    with pytest.raises(ValueError, match="not multiples of the patch"):
        hv.forward_inputs(**{**x, "hidden_states": x["hidden_states"][..., :5]}, config=cfg)
    with pytest.raises(ValueError, match="every prompt needs at least one real token"):
        hv.forward_inputs(**{**x, "encoder_attention_mask": 0 * x["encoder_attention_mask"]}, config=cfg)


def test_jaxdit_convert_to_orbax_loads_the_same_model(case, tmp_path):
    """``jaxdit convert`` of the diffusers folder -> an orbax folder recorded as this family, which
    ``jaxdit.load_transformer`` reads back on a mesh into the same forward (diffusers' call surface),
    bit for bit."""
    from jaxdit import families
    from jaxdit.cli import main

    folder, _, runs = case
    assert main(["convert", str(folder), str(tmp_path / "orbax")]) == 0
    assert families.detect_family(tmp_path / "orbax").name == "hunyuan-video15"
    x = dict(runs["i2v"][0])
    t = x.pop("timestep")
    run = lambda path: families.load_transformer(path, ParallelConfig(ulysses=2))(timestep=t, **x)
    got = run(tmp_path / "orbax")
    assert got.shape == (2, 2, FRAMES, HEIGHT, WIDTH)
    np.testing.assert_array_equal(got, run(folder))


def test_meanflow_second_timestep_matches_diffusers(tmp_path):
    """``use_meanflow`` (the step-distilled / super-resolution variants): a second timestep embedder
    added to the AdaLN vector; on ring2, image-to-video inputs. Without ``timestep_r`` (what diffusers'
    text-to-video pipeline passes) the term is left out, as diffusers does; the term moves the output by
    far more than the bound, so leaving it out (or adding it unasked) would be seen."""
    model = tiny.transformer(use_meanflow=True)
    model.save_pretrained(tmp_path / "transformer")
    x = tiny.inputs(FRAMES, HEIGHT, WIDTH, LENGTHS, GLYPH_LENGTHS, image=3)
    x["timestep_r"] = np.array([300.0, 20.0], np.float32)
    want = tiny.reference(model, x)
    want_without = tiny.reference(model, {k: v for k, v in x.items() if k != "timestep_r"})
    pc = ParallelConfig(ring=2)
    mesh = pc.make_mesh(jax.devices()[:2])
    params = load_params(tmp_path / "transformer", mesh, checkpoints=CHECKPOINTS)
    cfg = params.config
    args = {k: v for k, v in x.items() if k not in ("timestep", "timestep_r")}
    forward, inputs = hv.sharded(params, mesh), hv.forward_inputs(**args, config=cfg)
    grid = hv.latent_grid(x["hidden_states"].shape, cfg)
    run = lambda **t: hv.unpatchify(np.asarray(forward(**inputs, **t), np.float32), grid, cfg)
    got = run(timestep=x["timestep"], timestep_r=x["timestep_r"])
    tol.check(got, want, tol.TORCH_FORWARD, "HunyuanVideo 1.5 MeanFlow (ring2) vs diffusers")
    got_without = run(timestep=x["timestep"])
    tol.check(got_without, want_without, tol.TORCH_FORWARD, "MeanFlow without timestep_r vs diffusers")
    moved = float(np.abs(want - want_without).max())
    print(f"the r term moves the output by {moved:.3g}")
    assert moved > 100 * tol.TORCH_FORWARD.allowed(float(np.abs(want).max()))
