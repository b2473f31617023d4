"""Wan 2.1 checkpoint conversion: key tables, layout detection, config inference, strictness, export.

The tiny models of tests/wan_tiny.py are written in diffusers layout (``save_pretrained``) and in the
original layout (the inverted original key table). Corrupt copies must fail with a CheckpointError that
names the tensor and the file.
"""

import json
import shutil

import numpy as np
import pytest
import tolerance as tol
import wan_tiny

from converters import wan as cw
from converters.errors import CheckpointError, CheckpointKeyError
from converters.keymap import StateDict, invert, resolve
from converters.safetensors_io import open_checkpoint, write_safetensors
from jaxdit import cli
from jaxdit.families import convert_checkpoint, load_transformer
from jaxdit.models.wan import WanConfig, parameter_shapes

#: Quick CPU compiles for the few tests that run the model (numerics are tested elsewhere).
FAST = {"compiler_options": {"xla_backend_optimization_level": 0}}

# ------------------------------------------------------------------------------------------ key tables


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_original_table_round_trip_and_norm_swap(i2v):
    cfg, sd = wan_tiny.config(i2v), wan_tiny.state_dict(i2v)
    params = cw.diffusers_to_params(cfg, sd)
    original = invert(cw.original_table(cfg), params)
    # The original names and shapes (Wan-AI's wan/modules/model.py), at the tiny size.
    assert original["patch_embedding.weight"].shape == (96, wan_tiny.in_channels(i2v), 1, 2, 2)
    assert original["blocks.1.modulation"].shape == (1, 6, 96)
    assert original["head.modulation"].shape == (1, 2, 96)
    assert original["time_projection.1.weight"].shape == (6 * 96, 96)
    # The affine cross-attention norm is the original's norm3 and diffusers' norm2.
    np.testing.assert_array_equal(original["blocks.1.norm3.weight"], sd["blocks.1.norm2.weight"])
    np.testing.assert_array_equal(original["blocks.1.norm3.bias"], sd["blocks.1.norm2.bias"])
    assert not any(".norm2." in k for k in original)
    if i2v:
        np.testing.assert_array_equal(
            original["blocks.0.cross_attn.k_img.weight"], sd["blocks.0.attn2.add_k_proj.weight"]
        )
        np.testing.assert_array_equal(
            original["img_emb.proj.3.weight"], sd["condition_embedder.image_embedder.ff.net.2.weight"]
        )
        assert sum(k.startswith("img_emb.proj.") for k in original) == 8
    assert len(original) == len(sd)
    # Back through the original table: the same parameters, bit for bit.
    again = resolve(cw.original_table(cfg), StateDict(original), parameter_shapes(cfg))
    for path, value in params.items():
        np.testing.assert_array_equal(np.asarray(again[path]), value, err_msg=path)


def test_patch_embedding_is_the_conv():
    # The Conv3d (kernel = stride = patch) equals patchify + per-patch kernel.
    import torch

    from jaxdit.models.wan import patchify

    cfg, sd = wan_tiny.config(False), wan_tiny.state_dict(False)
    kernel = cw.diffusers_to_params(cfg, sd)["patch_embedding.kernel"]
    x = np.random.default_rng(0).standard_normal((2, 4, 3, 6, 10)).astype(np.float32)
    with torch.no_grad():
        conv = wan_tiny.model(False).patch_embedding(torch.from_numpy(x)).flatten(2).transpose(1, 2).numpy()
    ours = patchify(x, cfg.patch_size) @ kernel + sd["patch_embedding.bias"]
    tol.check(ours, conv, tol.TORCH_FORWARD, "patchify @ kernel vs Conv3d")


# ------------------------------------------------------------------------------------------ configs


def test_presets_have_the_published_parameter_counts():
    # Measured on the original WanModel (Wan-AI's wan/modules/model.py at the three sizes): 1.419 B, 14.288 B, 16.395 B.
    for name, billions in (
        ("wan2.1-t2v-1.3b", 1.419),
        ("wan2.1-t2v-14b", 14.288),
        ("wan2.1-i2v-14b", 16.395),
    ):
        cfg = WanConfig.preset(name)
        count = sum(int(np.prod(s)) for s in parameter_shapes(cfg).values())
        assert round(count / 1e9, 3) == billions, (name, count)
        assert cfg.rope_axes_dim == (44, 42, 42)
    with pytest.raises(ValueError, match="unknown Wan preset"):
        WanConfig.preset("wan2.2")


def test_from_diffusers_matches_presets():
    common = dict(patch_size=[1, 2, 2], text_dim=4096, freq_dim=256, eps=1e-6, out_channels=16)
    common.update(cross_attn_norm=True, qk_norm="rms_norm_across_heads", _class_name="WanTransformer3DModel")
    small = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30, in_channels=16)
    big = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40, in_channels=16)
    i2v = dict(big, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
    assert WanConfig.from_diffusers({**common, **small}) == WanConfig.preset("wan2.1-t2v-1.3b")
    assert WanConfig.from_diffusers({**common, **big}) == WanConfig.preset("wan2.1-t2v-14b")
    assert WanConfig.from_diffusers({**common, **i2v}) == WanConfig.preset("wan2.1-i2v-14b")
    with pytest.raises(ValueError, match="added_kv_proj_dim"):
        WanConfig.from_diffusers({**common, **big, "image_dim": 1280})  # image tokens through text K/V
    with pytest.raises(ValueError, match="FLF2V"):
        WanConfig.from_diffusers({**common, **i2v, "pos_embed_seq_len": 514})


def _original_shapes(cfg: WanConfig) -> dict[str, tuple[int, ...]]:
    """The original-layout shapes inference reads, for a full-size config (no tensors needed)."""
    e, patch = cfg.dim, cfg.patch_size
    shapes = {
        "patch_embedding.weight": (e, cfg.in_channels, *patch),
        "text_embedding.0.weight": (e, cfg.text_dim),
        "time_embedding.0.weight": (e, cfg.freq_dim),
        "head.head.weight": (cfg.out_channels * int(np.prod(patch)), e),
        "blocks.0.ffn.0.weight": (cfg.ffn_dim, e),
    }
    shapes.update({f"blocks.{i}.modulation": (1, 6, e) for i in range(cfg.num_layers)})
    if cfg.is_i2v:
        shapes["img_emb.proj.0.weight"] = (cfg.image_dim,)
    return shapes


@pytest.mark.parametrize("name", list(WanConfig.PRESETS))
def test_config_inferred_from_original_keys(name):
    cfg = WanConfig.preset(name)
    assert WanConfig.from_original_keys(_original_shapes(cfg)) == cfg
    original_json = cw.original_config_json(cfg)
    assert WanConfig.from_original(original_json) == cfg


def test_config_inference_needs_heads_when_dim_is_not_128s():
    with pytest.raises(ValueError, match="pass num_heads"):
        WanConfig.from_original_keys(_original_shapes(wan_tiny.config(False)))
    assert WanConfig.from_original_keys(
        _original_shapes(wan_tiny.config(False)), num_heads=8
    ) == wan_tiny.config(False)


# ------------------------------------------------------------------------------------------ detection


def test_detects_each_layout(tmp_path):
    for i2v in (False, True):
        ckpt = cw.detect(wan_tiny.original_folder(i2v))
        assert (ckpt.layout, ckpt.prefix, ckpt.config) == ("original", "", wan_tiny.config(i2v))
        assert ckpt.files.index_path is not None and len(ckpt.files.files) == 3
        ckpt = cw.detect(wan_tiny.diffusers_folder(i2v))
        assert (ckpt.layout, ckpt.config) == ("diffusers", wan_tiny.config(i2v))
    # A pipeline folder: the transformer lives in transformer/.
    shutil.copytree(wan_tiny.diffusers_folder(False), tmp_path / "pipe" / "transformer")
    assert cw.detect(tmp_path / "pipe").layout == "diffusers"
    assert cw.is_wan_checkpoint(tmp_path / "pipe")
    # ComfyUI-style single original file: keys prefixed, no config; the tiny head count is passed.
    single = tmp_path / "wan-comfy.safetensors"
    params = cw.diffusers_to_params(wan_tiny.config(False), wan_tiny.state_dict(False))
    write_safetensors(
        single, invert(cw.original_table(wan_tiny.config(False)), params, prefix=cw.ORIGINAL_PREFIX)
    )
    assert cw.is_wan_checkpoint(single)
    with pytest.raises(CheckpointError, match=f"{single.name}.*pass num_heads"):
        cw.detect(single)
    ckpt = cw.detect(single, wan_tiny.config(False))
    assert (ckpt.layout, ckpt.prefix) == ("original", cw.ORIGINAL_PREFIX)
    x, ref = wan_tiny.case(False)
    out = load_transformer(single, config=wan_tiny.config(False), **FAST)(**x)
    tol.check(out, ref, tol.TORCH_FORWARD_WAN, "ComfyUI-style single file vs diffusers")


def test_not_a_wan_checkpoint(tmp_path):
    write_safetensors(tmp_path / "other.safetensors", {"img_in.weight": np.zeros((2, 2), np.float32)})
    assert not cw.is_wan_checkpoint(tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="other.safetensors: not a Wan 2.1 checkpoint"):
        cw.detect(tmp_path / "other.safetensors")


# ------------------------------------------------------------------------------------------ corruption


def _copy_original(tmp_path, i2v=False):
    dst = tmp_path / "wan"
    shutil.copytree(wan_tiny.original_folder(i2v), dst)
    index = json.loads((dst / "diffusion_pytorch_model.safetensors.index.json").read_text())
    return dst, index["weight_map"]


def _rewrite(path, edit):
    with open_checkpoint(path) as f:
        tensors = {k: f.read(k) for k in f}
    edit(tensors)
    write_safetensors(path, tensors)


def _load_fails(path, *fragments):
    with pytest.raises(CheckpointError) as info:
        load_transformer(path)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    return info.value


def test_missing_tensor_names_key_and_index(tmp_path):
    dst, weight_map = _copy_original(tmp_path)
    key = "blocks.1.cross_attn.norm_k.weight"
    shard = dst / weight_map[key]
    _rewrite(shard, lambda t: t.pop(key))
    weight_map.pop(key)
    (dst / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    err = _load_fails(dst, key, "diffusion_pytorch_model.safetensors.index.json")
    assert isinstance(err, CheckpointKeyError)


def test_diffusers_name_in_original_file_is_unused(tmp_path):
    # The swapped norm under its diffusers name in an original file: not consumed, so an error.
    dst, weight_map = _copy_original(tmp_path)
    key = "blocks.0.norm3.weight"
    shard = dst / weight_map[key]

    def rename(t):
        t["blocks.0.norm2.weight"] = t.pop(key)

    _rewrite(shard, rename)
    weight_map["blocks.0.norm2.weight"] = weight_map.pop(key)
    (dst / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    _load_fails(dst, key)  # reported missing, with the unused one named as a hint
    # An extra tensor on top of a complete checkpoint: named with its file.
    dst2, weight_map2 = _copy_original(tmp_path / "b")
    shard2 = dst2 / weight_map2["head.head.weight"]
    _rewrite(shard2, lambda t: t.__setitem__("blocks.0.norm2.weight", np.ones(96, np.float32)))
    weight_map2["blocks.0.norm2.weight"] = shard2.name
    (dst2 / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map2})
    )
    _load_fails(dst2, "blocks.0.norm2.weight", shard2.name, "not used")


def test_mis_shaped_tensor_names_key_and_file(tmp_path):
    dst, weight_map = _copy_original(tmp_path, i2v=True)
    key = "blocks.1.ffn.0.weight"
    shard = dst / weight_map[key]
    _rewrite(shard, lambda t: t.__setitem__(key, np.zeros((41, 96), np.float32)))
    _load_fails(dst, key, shard.name, "(41, 96)")


def test_truncated_shard_names_the_file(tmp_path):
    dst, weight_map = _copy_original(tmp_path)
    shard = dst / weight_map["patch_embedding.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    _load_fails(dst, shard.name)


def test_missing_shard_file_names_it(tmp_path):
    dst, weight_map = _copy_original(tmp_path)
    shard = dst / weight_map["head.head.weight"]
    shard.unlink()
    _load_fails(dst, shard.name, "missing")


def test_diffusers_config_with_more_layers_than_weights(tmp_path):
    dst = tmp_path / "diffusers"
    shutil.copytree(wan_tiny.diffusers_folder(False), dst)
    config = json.loads((dst / "config.json").read_text())
    config["num_layers"] = 3
    (dst / "config.json").write_text(json.dumps(config))
    _load_fails(dst, "blocks.2.", "diffusion_pytorch_model.safetensors", "missing")


# ------------------------------------------------------------------------------------------ export


def test_convert_to_orbax_and_load(tmp_path, capsys):
    # Through the command line: the original-layout I2V folder -> a jaxdit orbax folder.
    dst = tmp_path / "wan-i2v-jaxdit"
    assert cli.main(["convert", str(wan_tiny.original_folder(True)), str(dst)]) == 0
    assert str(dst) in capsys.readouterr().out
    meta = json.loads((dst / "jaxdit.json").read_text())
    assert meta["family"] == "wan" and WanConfig.from_json(meta["config"]) == wan_tiny.config(True)
    x, ref = wan_tiny.case(True)
    out = load_transformer(dst, **FAST)(**x)
    tol.check(out, ref, tol.TORCH_FORWARD_WAN, "orbax folder (i2v) vs diffusers")
    with pytest.raises(FileExistsError):
        convert_checkpoint(wan_tiny.original_folder(True), dst)
    assert cli.main(["convert", str(wan_tiny.original_folder(True)), str(dst)]) == 2  # exists: an error
