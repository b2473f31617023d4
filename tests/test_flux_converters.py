"""FLUX checkpoints: layouts, key tables, corrupt inputs and the orbax round trip.

Every layout (diffusers folder, sharded diffusers folder, pipeline ``transformer/``, BFL file with and
without the ComfyUI prefix, jaxdit orbax folder) must load bit-identical parameters; every damaged
checkpoint must raise ``CheckpointError`` naming the key and the file, before anything is compiled.
"""

import json
import os
import shutil

import flux_tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
from flax import nnx

from converters import orbax_io
from converters.errors import CheckpointError, CheckpointKeyError
from converters.flux import BFL_PREFIX, bfl_table, detect, diffusers_table
from converters.keymap import StateDict, invert, resolve
from converters.safetensors_io import open_checkpoint, write_safetensors
from jaxdit import load_transformer
from jaxdit.cli import main as cli_main
from jaxdit.families import load_params
from jaxdit.mesh import ParallelConfig, single_device_mesh
from jaxdit.models.flux import FluxConfig, parameter_shapes
from jaxdit.models.partitioning import named_shardings

CFG = flux_tiny.config(True)


def _flat(model) -> dict[str, np.ndarray]:
    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


@pytest.fixture(scope="module")
def reference_params():
    _, model = load_params(flux_tiny.diffusers_folder(True), single_device_mesh())
    return _flat(model)


@pytest.fixture(scope="module")
def bfl_dict():
    """The tiny dev model as a BFL state dict (through the inverted BFL key table)."""
    from converters.flux import diffusers_to_params

    return invert(bfl_table(CFG), diffusers_to_params(CFG, flux_tiny.state_dict(True)))


@pytest.fixture(scope="module")
def bfl_file(tmp_path_factory, bfl_dict):
    return write_safetensors(tmp_path_factory.mktemp("bfl") / "flux-tiny.safetensors", bfl_dict)


# ------------------------------------------------------------------------------------------- key tables


@pytest.mark.parametrize(
    ("preset", "bfl_keys", "diffusers_keys"), [("flux-dev", 780, 1160), ("flux-schnell", 776, 1156)]
)
def test_tables_cover_full_size_flux(preset, bfl_keys, diffusers_keys):
    # Tensor counts of the real checkpoints (black-forest-labs/FLUX.1-dev and -schnell, flux1-*.safetensors).
    cfg = FluxConfig.preset(preset)
    params = set(parameter_shapes(cfg))
    for table, n in ((bfl_table(cfg), bfl_keys), (diffusers_table(cfg), diffusers_keys)):
        assert set(table.targets) == params, table.name
        assert len(table.source_keys()) == n, table.name


def test_config_inferred_from_full_size_bfl_keys():
    # flux-dev's shapes (reference section 2); only the keys inference reads, and every block index.
    e, f = 3072, 12288
    shapes = {
        "img_in.weight": (e, 64),
        "txt_in.weight": (e, 4096),
        "vector_in.in_layer.weight": (e, 768),
        "guidance_in.in_layer.weight": (e, 256),
        "final_layer.linear.weight": (64, e),
        "double_blocks.0.img_attn.qkv.bias": (3 * e,),
        "double_blocks.0.img_mlp.0.weight": (f, e),
    }
    shapes |= {f"double_blocks.{i}.img_attn.norm.query_norm.scale": (128,) for i in range(19)}
    shapes |= {f"single_blocks.{i}.linear1.weight": (3 * e + f, e) for i in range(38)}
    assert FluxConfig.from_bfl_keys(shapes) == FluxConfig.preset("flux-dev")
    del shapes["guidance_in.in_layer.weight"]
    assert FluxConfig.from_bfl_keys(shapes) == FluxConfig.preset("flux-schnell")


def test_bfl_file_structure(bfl_dict):
    # The inverted table writes BFL's fused tensors from diffusers' pieces (reference section 2).
    sd, e = flux_tiny.state_dict(True), CFG.hidden_size
    b = "transformer_blocks.1.attn."
    np.testing.assert_array_equal(
        bfl_dict["double_blocks.1.txt_attn.qkv.weight"],
        np.concatenate(
            [sd[b + "add_q_proj.weight"], sd[b + "add_k_proj.weight"], sd[b + "add_v_proj.weight"]]
        ),
    )
    s = "single_transformer_blocks.0."
    np.testing.assert_array_equal(
        bfl_dict["single_blocks.0.linear1.bias"],
        np.concatenate([sd[s + f"attn.to_{n}.bias"] for n in "qkv"] + [sd[s + "proj_mlp.bias"]]),
    )
    np.testing.assert_array_equal(bfl_dict["single_blocks.0.linear2.weight"], sd[s + "proj_out.weight"])
    scale, shift = np.split(sd["norm_out.linear.weight"], 2)
    np.testing.assert_array_equal(
        bfl_dict["final_layer.adaLN_modulation.1.weight"], np.concatenate([shift, scale])
    )
    assert bfl_dict["double_blocks.0.img_attn.qkv.weight"].shape == (3 * e, e)
    assert len(bfl_dict) == len(bfl_table(CFG).source_keys())


def test_inverse_round_trip(bfl_dict):
    params = resolve(bfl_table(CFG), StateDict(bfl_dict), parameter_shapes(CFG))
    again = invert(bfl_table(CFG), {k: np.asarray(v) for k, v in params.items()})
    assert again.keys() == bfl_dict.keys()
    for k in bfl_dict:
        np.testing.assert_array_equal(again[k], bfl_dict[k])


# ---------------------------------------------------------------------------------------------- layouts


def test_every_layout_loads_the_same_parameters(tmp_path, bfl_dict, bfl_file, reference_params):
    model = flux_tiny.model(True)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert list(sharded.glob("*.safetensors.index.json"))
    pipeline = tmp_path / "pipeline"
    shutil.copytree(flux_tiny.diffusers_folder(True), pipeline / "transformer")
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    prefixed = write_safetensors(
        tmp_path / "comfy.safetensors", {BFL_PREFIX + k: v for k, v in bfl_dict.items()}
    )
    single = write_safetensors(tmp_path / "diffusers.safetensors", flux_tiny.state_dict(True))

    cases = {
        "diffusers sharded": (sharded, "diffusers", ""),
        "pipeline folder": (pipeline, "diffusers", ""),
        "BFL": (bfl_file, "bfl", ""),
        "BFL prefixed": (prefixed, "bfl", BFL_PREFIX),
        "diffusers single file": (single, "diffusers", ""),
    }
    for name, (path, layout, prefix) in cases.items():
        ckpt = detect(path, CFG)
        assert (ckpt.layout, ckpt.prefix) == (layout, prefix), name
        _, loaded = load_params(path, single_device_mesh(), config=CFG)
        params = _flat(loaded)
        assert params.keys() == reference_params.keys()
        for k, v in reference_params.items():
            np.testing.assert_array_equal(params[k], v, err_msg=f"{name}: {k}")


def test_bfl_config_inference_needs_the_rope_split_for_tiny_heads(bfl_file):
    # head_dim 16: the RoPE split is not in the weights, and the error says what to pass.
    with pytest.raises(CheckpointError, match=r"flux-tiny.safetensors.*axes_dim"):
        detect(bfl_file)
    inferred = detect(bfl_file, FluxConfig.from_bfl_keys(_shapes(bfl_file), axes_dim=flux_tiny.AXES)).config
    assert inferred == CFG


def _shapes(path):
    ckpt = open_checkpoint(path)
    return {k: ckpt.shape(k) for k in ckpt}


def test_bf16_checkpoint_stays_bf16_and_dtype_casts(tmp_path, bfl_dict, reference_params):
    bf16 = {k: v.astype(jnp.bfloat16) for k, v in bfl_dict.items()}
    path = write_safetensors(tmp_path / "bf16.safetensors", bf16)
    _, model = load_params(path, single_device_mesh(), config=CFG)
    assert model.img_in.kernel.get_value().dtype == jnp.bfloat16  # the storage dtype by default
    _, model = load_params(path, single_device_mesh(), jnp.float32, config=CFG)
    params = _flat(model)
    k = "double_blocks.img_attn.q.kernel"
    assert params[k].dtype == np.float32
    np.testing.assert_array_equal(params[k], reference_params[k].astype(jnp.bfloat16).astype(np.float32))


# -------------------------------------------------------------------------------------- corrupt inputs


def _load(path):
    return load_transformer(path, config=CFG)


def test_truncated_file(tmp_path, bfl_file):
    path = tmp_path / "truncated.safetensors"
    data = bfl_file.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"truncated\.safetensors.*(truncated|shorter|size)"):
        _load(path)


def test_missing_key(tmp_path, bfl_dict):
    key = "double_blocks.1.txt_mlp.2.bias"
    path = write_safetensors(
        tmp_path / "missing.safetensors", {k: v for k, v in bfl_dict.items() if k != key}
    )
    with pytest.raises(CheckpointKeyError, match=rf"missing\.safetensors.*missing tensor '{key}'"):
        _load(path)


def test_renamed_key(tmp_path, bfl_dict):
    old, new = "single_blocks.0.linear2.weight", "single_blocks.0.linear_2.weight"
    renamed = {(new if k == old else k): v for k, v in bfl_dict.items()}
    path = write_safetensors(tmp_path / "renamed.safetensors", renamed)
    with pytest.raises(CheckpointKeyError, match=rf"renamed\.safetensors.*'{old}'.*'{new}'") as e:
        _load(path)
    assert "renamed?" in str(e.value)


@pytest.mark.parametrize(
    ("key", "change"),
    [
        ("double_blocks.0.img_attn.qkv.weight", lambda v: np.concatenate([v, v[:1]])),  # one row too many
        ("img_in.weight", lambda v: v.T.copy()),
        ("single_blocks.1.norm.key_norm.scale", lambda v: v[:-2]),
        ("final_layer.adaLN_modulation.1.bias", lambda v: v[:-1]),
    ],
    ids=["qkv_extra_row", "img_in_transposed", "norm_scale_short", "final_odd"],
)
def test_wrong_shape(tmp_path, bfl_dict, key, change):
    bad = dict(bfl_dict)
    bad[key] = change(bad[key])
    path = write_safetensors(tmp_path / "shape.safetensors", bad)
    with pytest.raises(CheckpointError, match=rf"shape\.safetensors: tensor '{key}'.*shape"):
        _load(path)


def test_extra_key(tmp_path, bfl_dict):
    path = write_safetensors(
        tmp_path / "extra.safetensors", {**bfl_dict, "lora.up.weight": np.zeros(3, np.float32)}
    )
    with pytest.raises(CheckpointError, match=r"extra\.safetensors: tensor 'lora\.up\.weight' is not used"):
        _load(path)


def test_missing_shard_of_sharded_folder(tmp_path):
    folder = tmp_path / "sharded"
    flux_tiny.model(True).save_pretrained(folder, max_shard_size="40KB")
    victim = sorted(folder.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        _load(folder)


def test_not_a_checkpoint(tmp_path):
    path = write_safetensors(tmp_path / "other.safetensors", {"w": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError, match=r"other\.safetensors: not a checkpoint"):
        _load(path)


# ------------------------------------------------------------------------------------------------ orbax


def test_convert_and_restore_into_shardings(tmp_path, reference_params):
    dst = tmp_path / "flux-tiny.jaxdit"
    assert cli_main(["convert", str(flux_tiny.diffusers_folder(True)), str(dst)]) == 0
    assert orbax_io.read_metadata(dst)["family"] == "flux"
    # The config travels with the checkpoint: no config= needed to load it.
    mesh = ParallelConfig(tensor=4, ulysses=2).make_mesh()
    _, model = load_params(dst, mesh)
    state = nnx.state(model, nnx.Param)
    want = named_shardings(state, __import__("sharding_rules").rules_for(tensor=4), mesh)
    for (path, v), (_, s) in zip(nnx.to_flat_state(state), nnx.to_flat_state(want), strict=True):
        value = v.get_value()
        assert value.sharding.is_equivalent_to(s.get_value(), value.ndim), path
        np.testing.assert_array_equal(np.asarray(value), reference_params[".".join(path)])
    q = model.double_blocks.img_attn.q.kernel.get_value()
    assert q.addressable_shards[0].data.shape == (2, CFG.hidden_size, CFG.hidden_size // 4)

    # bf16 conversion; restoring it as bf16 by default.
    dst16 = tmp_path / "flux-tiny-bf16.jaxdit"
    assert (
        cli_main(["convert", str(flux_tiny.diffusers_folder(True)), str(dst16), "--dtype", "bfloat16"]) == 0
    )
    _, model16 = load_params(dst16, single_device_mesh())
    params16 = _flat(model16)
    k = "single_blocks.out_mlp.kernel"
    assert params16[k].dtype == jnp.bfloat16
    np.testing.assert_array_equal(params16[k], reference_params[k].astype(jnp.bfloat16))


def test_failed_conversion_leaves_nothing(tmp_path, bfl_dict, capsys):
    bad = write_safetensors(
        tmp_path / "bad.safetensors", {k: v for k, v in bfl_dict.items() if "txt_in" not in k}
    )
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "converted"
    assert cli_main(["convert", str(bad), str(dst)]) == 2
    err = capsys.readouterr().err
    assert "bad.safetensors" in err and "no tensor 'txt_in.weight'" in err
    assert os.listdir(out) == []  # no DST, no temporary folder

    good = flux_tiny.diffusers_folder(True)
    assert cli_main(["convert", str(good), str(dst)]) == 0
    assert cli_main(["convert", str(good), str(dst)]) == 2  # exists
    assert cli_main(["convert", str(good), str(dst), "--overwrite"]) == 0
    assert os.listdir(out) == ["converted"]


def test_orbax_restore_failure_names_the_folder(tmp_path):
    dst = tmp_path / "broken.jaxdit"
    assert cli_main(["convert", str(flux_tiny.diffusers_folder(False)), str(dst)]) == 0
    shutil.rmtree(dst / "params")
    (dst / "params").mkdir()
    with pytest.raises(CheckpointError, match=r"broken\.jaxdit"):
        load_params(dst, single_device_mesh())


def test_load_transformer_on_orbax_checkpoint_runs(tmp_path):
    dst = tmp_path / "schnell.jaxdit"
    assert cli_main(["convert", str(flux_tiny.diffusers_folder(False)), str(dst)]) == 0
    fn = load_transformer(dst, compiler_options={"xla_backend_optimization_level": 0})
    x, ref = flux_tiny.case(False)
    tol.check(fn(**x), ref, tol.TORCH_FORWARD, "orbax folder (schnell) vs diffusers")
    assert isinstance(fn.params, nnx.State) and jax.tree.leaves(fn.params)
