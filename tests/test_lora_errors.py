"""LoRA files that cannot be applied fail before any device work, naming the file and the key, and a
failed load leaves the base weights as they were (same arrays, bit for bit, still usable)."""

import functools

import flux_tiny
import jax
import lora_tiny
import numpy as np
import pytest
import wan_tiny
from flax import nnx

from converters.lora import LoraError, read_lora
from converters.safetensors_io import write_safetensors
from jaxdit.families import load_params
from jaxdit.lora import fuse_loras
from jaxdit.mesh import ParallelConfig

FLUX = flux_tiny.config(lora_tiny.GUIDANCE)
WAN = wan_tiny.config(False)
E = FLUX.hidden_size


def _write(name: str, tensors: dict) -> str:
    return str(write_safetensors(lora_tiny.ROOT / name, tensors))


def _pair(key: str, out: int, inp: int, rank: int = 4, seed: int = 0) -> dict:
    down, up = lora_tiny.factors(np.random.default_rng(seed), out, inp, rank)
    return {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up}


@functools.cache
def _good() -> str:
    shapes = lora_tiny.bfl_shapes()
    return str(
        lora_tiny.write_kohya_style(
            lora_tiny.ROOT / "errors-good.safetensors",
            shapes,
            lora_tiny.linear_modules(shapes),
            prefix="lora_unet_",
            underscore=True,
        )
    )


def _error(path: str, config=FLUX) -> str:
    with pytest.raises(LoraError) as info:
        read_lora(path, config)
    message = str(info.value)
    assert path in message, message
    return message


def test_lora_for_another_family():
    message = _error(_good(), WAN)
    assert "a LoRA for FLUX" in message and "the model is WAN" in message


def test_lora_for_another_model_size():
    """A LoRA for a wider FLUX: the factors' shapes are checked against the model's."""
    path = _write(
        "errors-size.safetensors", _pair("lora_unet_double_blocks_0_img_attn_qkv", 3 * 2 * E, 2 * E)
    )
    message = _error(path)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight" in message
    assert "another model size" in message


def test_block_the_model_does_not_have():
    tensors = _pair("lora_unet_double_blocks_0_img_attn_proj", E, E)
    tensors.update(_pair("lora_unet_double_blocks_7_img_attn_proj", E, E))
    message = _error(_write("errors-depth.safetensors", tensors))
    assert "'lora_unet_double_blocks_7_img_attn_proj.lora_down.weight' matches no parameter" in message
    assert "kohya layout" in message


def test_unknown_layout():
    tensors = {"encoder.layer.0.w1.lora_down.weight": np.zeros((4, 8), np.float32)}
    message = _error(_write("errors-unknown.safetensors", tensors))
    assert "unknown LoRA layout" in message and "'encoder.layer.0.w1.lora_down.weight'" in message
    assert "kohya, bfl, diffusers, kohya-diffusers, xlabs" in message


def test_rank_mismatch():
    tensors = _pair("lora_unet_double_blocks_0_img_attn_proj", E, E)
    tensors["lora_unet_double_blocks_0_img_attn_proj.lora_up.weight"] = np.zeros((E, 3), np.float32)
    message = _error(_write("errors-rank.safetensors", tensors))
    assert (
        "rank mismatch" in message and "'lora_unet_double_blocks_0_img_attn_proj.lora_down.weight'" in message
    )


def test_rank_mismatch_with_peft_metadata():
    """diffusers' metadata says r=8, the tensors have rank 4."""
    import json

    tensors = {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": np.zeros((4, E), np.float32),
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": np.zeros((E, 4), np.float32),
    }
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 8, "transformer.lora_alpha": 8})}
    path = str(write_safetensors(lora_tiny.ROOT / "errors-peft-rank.safetensors", tensors, meta))
    message = _error(path)
    assert "rank mismatch" in message and "r=8" in message and "lora_B.weight" in message


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf(bad):
    tensors = _pair("lora_unet_double_blocks_1_txt_mlp_0", FLUX.mlp_hidden, E)
    tensors["lora_unet_double_blocks_1_txt_mlp_0.lora_up.weight"][3, 1] = bad
    message = _error(_write("errors-nan.safetensors", tensors))
    assert "'lora_unet_double_blocks_1_txt_mlp_0.lora_up.weight' holds 1 NaN/inf" in message


def test_missing_alpha_where_the_layout_needs_one():
    """musubi-tuner writes an alpha per module; a file without one is damaged."""
    path = lora_tiny.write_kohya_style(
        lora_tiny.ROOT / "errors-alpha.safetensors",
        lora_tiny.original_shapes(),
        ["blocks.0.self_attn.q", "blocks.1.ffn.0"],
        prefix="lora_unet_",
        underscore=True,
        alpha=None,
    )
    message = _error(str(path), WAN)
    assert "no alpha" in message and "musubi" in message and "lora_unet_blocks_0_self_attn_q.alpha" in message


def test_missing_partner_factor():
    tensors = _pair("lora_unet_single_blocks_0_linear2", E, E + FLUX.mlp_hidden)
    del tensors["lora_unet_single_blocks_0_linear2.lora_up.weight"]
    message = _error(_write("errors-partner.safetensors", tensors))
    assert "'lora_unet_single_blocks_0_linear2.lora_down.weight' has no lora_up partner" in message


@pytest.mark.parametrize(
    "key, why",
    [
        ("lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", "text-encoder"),
        ("lora_unet_double_blocks_0_img_attn_proj.dora_scale", "DoRA"),
        ("lora_unet_double_blocks_0_img_attn_proj.lokr_w1", "LoKr"),
    ],
)
def test_weights_not_fused_here(key, why):
    tensors = _pair("lora_unet_double_blocks_0_img_attn_proj", E, E)
    tensors[key] = np.zeros((4, 4), np.float32)
    message = _error(_write("errors-unsupported.safetensors", tensors))
    assert repr(key) in message and why in message


def test_pickle_files_are_not_read(tmp_path):
    path = tmp_path / "lora.pt"
    path.write_bytes(b"\x80\x04not read")
    message = _error(str(path))
    assert "pickle" in message


def test_failed_load_leaves_the_base_untouched():
    """A good file and a broken one (NaN in its last module): nothing is fused, the same arrays hold the
    same bits and the model still runs."""
    config = ParallelConfig(tensor=2)
    _, model = load_params(
        flux_tiny.diffusers_folder(lora_tiny.GUIDANCE), config.make_mesh(jax.devices()[:2])
    )
    state = nnx.state(model, nnx.Param)
    arrays = {p: v.get_value() for p, v in nnx.to_flat_state(state)}
    before = {p: np.asarray(a) for p, a in arrays.items()}
    tensors = _pair("lora_unet_final_layer_linear", FLUX.out_channels, E)
    tensors["lora_unet_final_layer_linear.lora_down.weight"][0, 0] = np.nan
    broken = _write(
        "errors-broken.safetensors", {**_pair("lora_unet_txt_in", E, FLUX.context_in_dim), **tensors}
    )
    with pytest.raises(LoraError, match="NaN/inf"):
        fuse_loras(state, FLUX, [_good(), (broken, 0.5)])
    for path, var in nnx.to_flat_state(state):
        assert var.get_value() is arrays[path]  # not even replaced
        np.testing.assert_array_equal(np.asarray(var.get_value()), before[path])
    with pytest.raises(ValueError, match="not finite"):
        fuse_loras(state, FLUX, [(_good(), float("nan"))])


def test_overflowing_fused_weights_name_the_lora_and_convert_writes_nothing(tmp_path, capsys):
    """A finite file overflows once fused (x 1e300 in float32, x 1e30 in float16). Before: the run stopped at step 1 advising a
    "damaged checkpoint" without naming the LoRA, and `jaxdit convert --dtype float16` wrote a checkpoint
    with all-inf parameters and exited 0."""
    from jaxdit import cli

    folder = flux_tiny.diffusers_folder(lora_tiny.GUIDANCE)
    _, model = load_params(folder, ParallelConfig().make_mesh(jax.devices()[:1]))
    with pytest.raises(
        ValueError, match=rf"fusing the LoRA {_good()} x 1e\+300 made \d+ weight\(s\) non-finite"
    ):
        fuse_loras(model, FLUX, [(_good(), 1e300)])
    dst = tmp_path / "converted"
    argv = ["convert", str(folder), str(dst), "--lora", f"{_good()}:1e30", "--dtype", "float16"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "non-finite in float16" in err and _good() in err, err
    assert not dst.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name, tensors, says",
    [
        ("1-D down", {".lora_down.weight": (32,), ".lora_up.weight": (E, 1)}, "are not"),
        ("transposed", {".lora_down.weight": (32, 4), ".lora_up.weight": (4, E)}, "has rank 32 but"),
        (
            "alpha not a scalar",
            {".lora_down.weight": (4, 32), ".lora_up.weight": (E, 4), ".alpha": (2,)},
            "expected a scalar",
        ),  # noqa: E501
        ("no tensors", {}, "holds no tensors"),
    ],
)
def test_degenerate_shapes_are_refused_by_name(name, tensors, says):
    key = "lora_unet_txt_in"
    path = _write(
        f"degenerate-{name.replace(' ', '-')}.safetensors",
        {key + k: np.ones(s, np.float32) for k, s in tensors.items()},
    )
    message = _error(path)
    assert says in message, message


def test_degenerate_shapes_that_mean_something_are_applied_as_such():
    """Rank 0 is no update (zeros), and a factor with trailing unit axes (a 1x1 kernel) is a linear one."""
    key = "lora_unet_txt_in"
    rank0 = _write(
        "degenerate-rank0.safetensors",
        {
            f"{key}.lora_down.weight": np.zeros((0, 32), np.float32),
            f"{key}.lora_up.weight": np.zeros((E, 0), np.float32),
        },
    )  # noqa: E501
    (update,) = read_lora(rank0, FLUX).updates
    assert update.a.shape == (32, 0) and update.b.shape == (0, E)
    unit = _pair(key, E, 32)
    unit[f"{key}.lora_up.weight"] = unit[f"{key}.lora_up.weight"][..., None]
    (squeezed,) = read_lora(_write("degenerate-unit.safetensors", unit), FLUX).updates
    (plain,) = read_lora(_write("degenerate-plain.safetensors", _pair(key, E, 32)), FLUX).updates
    np.testing.assert_array_equal(squeezed.a @ squeezed.b, plain.a @ plain.b)
