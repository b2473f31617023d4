"""HunyuanVideo 1.5 checkpoints as Tencent publishes them and as ComfyUI repackages them, read through
``converters/hunyuan_video15.py``'s original tables, against the diffusers folder of the same weights.

The original files are written from a tiny random diffusers model by the tests' own inverse of diffusers'
``scripts/convert_hunyuan_video1_5_to_diffusers.py`` (``hunyuan_video15_original_names.py``):
Tencent's names, the refiner's fused ``self_attn_qkv``, the final modulation in (shift, scale) order, and
for ComfyUI's file the double blocks' q, k, v fused into ``img_attn_qkv`` / ``txt_attn_qkv`` under
``model.diffusion_model.``. Parameters must be bit-identical to the diffusers folder's; one forward per
layout is compared with diffusers (fp32, tests/tolerance.py; ``pytest -s`` prints the errors).
"""

from __future__ import annotations

import json

import hunyuan_video15_original_names as names
import hunyuan_video15_tiny as tiny
import jax
import numpy as np
import pytest
import tolerance as tol

from converters.errors import CheckpointError
from converters.hunyuan_video15 import CHECKPOINTS, config_from_shapes, detect, original_table
from converters.safetensors_io import write_safetensors
from jaxdit.loading.params import load_params
from jaxdit.mesh import single_device_mesh
from jaxdit.models import hunyuan_video15 as hv
from jaxdit.models.hunyuan_video15_config import HunyuanVideo15Config

FRAMES, HEIGHT, WIDTH = 3, 4, 6
CONFIG = HunyuanVideo15Config(**tiny.CONFIG)


def tencent_config() -> dict:
    """A Tencent ``config.json`` of the tiny model (the fields its loader records)."""
    c = tiny.CONFIG
    return {
        "_class_name": "HunyuanVideo_1_5_DiffusionTransformer",
        "patch_size": [c["patch_size_t"], c["patch_size"], c["patch_size"]],
        "in_channels": c["in_channels"],
        "out_channels": c["out_channels"],
        "hidden_size": c["num_attention_heads"] * c["attention_head_dim"],
        "heads_num": c["num_attention_heads"],
        "mm_double_blocks_depth": c["num_layers"],
        "mm_single_blocks_depth": 0,
        "rope_dim_list": list(c["rope_axes_dim"]),
        "rope_theta": 256,
        "qk_norm_type": "rms",
        "guidance_embed": False,
        "text_pool_type": None,
        "glyph_byT5_v2": True,
        "vision_projection": "linear",
        "use_cond_type_embedding": True,
        "ideal_resolution": "480p",
        "ideal_task": "i2v",
    }


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(diffusers folder, {layout: path}, inputs, diffusers' output, diffusers-loaded parameters, Tencent's
    state dict)."""
    root = tmp_path_factory.mktemp("hunyuan_video15_original")
    model = tiny.transformer()
    model.save_pretrained(root / "transformer")
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    tencent = root / "480p_i2v"
    tencent.mkdir()
    (tencent / "config.json").write_text(json.dumps(tencent_config()))
    original = names.original_state_dict(sd, CONFIG.num_layers, CONFIG.num_refiner_layers, fused_qkv=False)
    write_safetensors(tencent / "diffusion_pytorch_model.safetensors", original)
    comfy = {
        f"model.diffusion_model.{k}": v
        for k, v in names.original_state_dict(
            sd, CONFIG.num_layers, CONFIG.num_refiner_layers, fused_qkv=True
        ).items()
    }
    paths = {
        "tencent": tencent,
        "comfyui": write_safetensors(root / "hunyuanvideo1.5_tiny_comfy.safetensors", comfy),
    }
    x = tiny.inputs(FRAMES, HEIGHT, WIDTH, [5, 2], [0, 2], image=3)
    want = tiny.reference(model, x)
    base = load_params(root / "transformer", single_device_mesh(), checkpoints=CHECKPOINTS)
    return root / "transformer", paths, x, want, base, original


def _leaves(model):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(model)}


def _forward(model, x):
    cfg = model.config
    args = {k: v for k, v in x.items() if k != "timestep"}
    out = hv.sharded(model, single_device_mesh())(
        **hv.forward_inputs(**args, config=cfg), timestep=x["timestep"]
    )
    return np.asarray(
        hv.unpatchify(np.asarray(out, np.float32), hv.latent_grid(x["hidden_states"].shape, cfg), cfg)
    )


@pytest.mark.parametrize("layout", ["tencent", "comfyui"])
def test_original_layouts_load_the_diffusers_parameters(case, layout):
    """Every parameter bit-identical to the diffusers folder's, and one forward vs diffusers."""
    from jaxdit import families

    folder, paths, x, want, base, _ = case
    path = paths[layout]
    assert families.detect_family(path).name == "hunyuan-video15"
    opened = detect(path, CONFIG if layout == "comfyui" else None)
    assert opened.layout == ("original" if layout == "tencent" else "comfyui")
    assert opened.prefix == ("" if layout == "tencent" else "model.diffusion_model.")
    assert opened.config == detect(folder).config  # the Tencent folder's from its config.json and shapes
    model = load_params(path, single_device_mesh(), checkpoints=CHECKPOINTS, config=opened.config)
    got, ref = _leaves(model), _leaves(base)
    assert got.keys() == ref.keys()
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    tol.check(_forward(model, x), want, tol.TORCH_FORWARD, f"HunyuanVideo 1.5 {layout} file vs diffusers")


def test_jaxdit_convert_of_the_tencent_folder(case, tmp_path):
    """``jaxdit convert`` of Tencent's folder -> an orbax folder of this family with the same parameters."""
    from jaxdit import families
    from jaxdit.cli import main

    _, paths, _, _, base, _ = case
    assert main(["convert", str(paths["tencent"]), str(tmp_path / "orbax")]) == 0
    assert families.detect_family(tmp_path / "orbax").name == "hunyuan-video15"
    model = load_params(tmp_path / "orbax", single_device_mesh(), checkpoints=CHECKPOINTS)
    assert model.config == CONFIG
    got, ref = _leaves(model), _leaves(base)
    assert got.keys() == ref.keys() and all(np.array_equal(got[k], ref[k]) for k in ref)


def test_bad_original_files_are_refused(case, tmp_path):
    _, paths, _, _, _, sd = case
    with pytest.raises(CheckpointError, match=r"head_dim 16: pass the config"):
        detect(paths["comfyui"])  # the RoPE split of a head width other than 128 is not in the weights
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "config.json").write_text(json.dumps(tencent_config()))
    write_safetensors(
        extra / "model.safetensors",
        {**sd, "double_blocks.0.img_attn_extra.weight": sd["cond_type_embedding.weight"]},
    )
    with pytest.raises(CheckpointError, match=r"img_attn_extra.*not used"):
        load_params(extra, single_device_mesh(), checkpoints=CHECKPOINTS)
    single = {**sd, "single_blocks.0.linear1.weight": sd["cond_type_embedding.weight"]}
    path = write_safetensors(tmp_path / "single.safetensors", single)
    with pytest.raises(CheckpointError, match="single-stream blocks"):
        detect(path, CONFIG)
    (extra / "config.json").write_text(json.dumps({**tencent_config(), "mm_single_blocks_depth": 40}))
    with pytest.raises(CheckpointError, match="mm_single_blocks_depth 40"):
        detect(extra)


@pytest.mark.parametrize("fused", [False, True])
def test_full_size_config_from_shapes(fused):
    """Tencent's 480p file and ComfyUI's: the 8.3B model's config from the tensors' shapes alone."""
    from jaxdit.models.hunyuan_video15 import parameter_shapes

    cfg = HunyuanVideo15Config()
    table, shapes = original_table(cfg, fused_qkv=fused), parameter_shapes(cfg)
    sources = {}
    for rule in table.rules:
        shape = shapes[rule.target][1:] if rule.stack else shapes[rule.target]
        if rule.target.endswith("kernel"):
            shape = shape[::-1]
        for keys in table.source_sets(rule):
            sources[keys[0]] = shape
    # The patch embedding's Conv3d weight [E, C, pt, ph, pw] (its kernel is the flattened patch).
    sources["img_in.proj.weight"] = (cfg.hidden_size, cfg.in_channels, *cfg.patch)
    got = config_from_shapes(sources)
    assert got == cfg, got
