"""Reliability: bad checkpoints and bad ``dtype=`` through the readers and the API.

Each case is one thing wrong with an otherwise good tiny checkpoint. Asserted for each: the exception type,
that the message names the tensor or array (and the file), that checks which need only headers and
metadata fail before any tensor is read, and that a failed conversion writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flux_tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import wan_tiny
from reliability_support import (
    forbid_orbax_reads,
    forbid_tensor_reads,
    largest_data_file,
    listing,
    variant,
)

from converters import orbax_io
from converters.errors import CheckpointError
from converters.flux import bfl_table, diffusers_to_params
from converters.keymap import invert
from converters.safetensors_io import open_checkpoint, write_safetensors
from jaxdit.families import convert_checkpoint, load_params, load_transformer
from jaxdit.mesh import ParallelConfig, single_device_mesh


def _set(key: str, value: Any, index: Any = (0, 0)) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        tensors[key] = tensors[key].copy()
        tensors[key][index] = value

    return edit


def _retype(key: str, dtype: Any) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        tensors[key] = tensors[key].astype(dtype)

    return edit


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    edit: Callable[[dict], None]
    match: str  # what the message must name
    dtype: Any = None
    headers_only: bool = False  # must fail before any tensor is read
    error: type[Exception] = CheckpointError


Q1 = "transformer_blocks.1.attn.to_q.weight"
# One thing wrong with the tiny FLUX diffusers checkpoint (fp32, one file).
FLUX_CASES = [
    Case("nan-weight", _set(Q1, np.nan), rf"'{Q1}' holds 1\b"),
    Case("inf-bias", _set("x_embedder.bias", np.inf, 3), r"'x_embedder.bias' holds 1\b"),
    Case(
        "minus-inf-norm",
        _set("single_transformer_blocks.0.attn.norm_q.weight", -np.inf, 0),
        r"'single_transformer_blocks.0.attn.norm_q.weight'",
    ),
    Case("all-nan", _set("proj_out.weight", np.nan, ...), r"'proj_out.weight' holds \d+"),
    Case("overflows-float16", _set("proj_out.weight", 1e6), r"beyond float16's range", dtype="float16"),
    Case(
        "int32-tensor",
        _retype("context_embedder.bias", np.int32),
        r"'context_embedder.bias' is int32",
        headers_only=True,
    ),
    Case(
        "bool-tensor",
        _retype("norm_out.linear.bias", np.bool_),
        r"'norm_out.linear.bias' is bool",
        headers_only=True,
    ),
    Case(
        "uint8-tensor",
        _retype("x_embedder.weight", np.uint8),
        r"'x_embedder.weight' is uint8",
        headers_only=True,
    ),
    Case(
        "int64-in-a-layer",
        _retype("single_transformer_blocks.1.proj_out.bias", np.int64),
        r"'single_transformer_blocks.1.proj_out.bias' is int64",
        headers_only=True,
    ),
]


@pytest.mark.parametrize("case", FLUX_CASES, ids=lambda c: c.name)
def test_bad_flux_checkpoint_is_named(case, tmp_path, monkeypatch):
    src = variant(flux_tiny.diffusers_folder(False), tmp_path / "ckpt", case.edit)
    if case.headers_only:
        forbid_tensor_reads(monkeypatch)
    with pytest.raises(case.error, match=case.match) as info:
        load_transformer(src, dtype=case.dtype)
    assert "diffusion_pytorch_model.safetensors" in str(info.value)


def test_nan_in_a_sharded_wan_checkpoint_names_tensor_and_shard(tmp_path):
    # Wan's original layout in three shard files; the NaN sits in one block's tensor.
    original = wan_tiny.original_folder(False)
    src = tmp_path / "wan"
    shutil.copytree(original, src)
    with open_checkpoint(src) as ckpt:
        key = next(k for k in ckpt if k.startswith("blocks.1.") and k.endswith("ffn.0.weight"))
        file = ckpt.file_of(key)
        tensors = {k: ckpt.read(k) for k in ckpt if ckpt.file_of(k) == file}
    tensors[key][1, 2] = np.nan
    write_safetensors(file, tensors)
    with pytest.raises(CheckpointError, match=rf"'{key}' holds 1\b") as info:
        load_params(src, ParallelConfig(tensor=2).make_mesh(jax.devices()[:2]))
    assert file.name in str(info.value)


def test_int32_in_wan_diffusers_checkpoint_fails_on_headers(tmp_path, monkeypatch):
    key = "blocks.0.attn1.to_k.bias"
    src = variant(wan_tiny.diffusers_folder(False), tmp_path / "wan", _retype(key, np.int32))
    forbid_tensor_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"'{key}' is int32"):
        load_params(src, single_device_mesh())


def test_nan_in_fused_bfl_qkv_is_named(tmp_path):
    cfg = flux_tiny.config(True)
    tensors = invert(bfl_table(cfg), diffusers_to_params(cfg, flux_tiny.state_dict(True)))
    key = "double_blocks.0.img_attn.qkv.weight"
    tensors[key][-1, 0] = np.nan  # in the V third of the fused tensor
    src = write_safetensors(tmp_path / "flux1-tiny.safetensors", tensors)
    with pytest.raises(CheckpointError, match=rf"(?s)flux1-tiny.safetensors.*'{key}' holds 1 NaN"):
        load_transformer(src, config=cfg)


# ------------------------------------------------------------------------------------------- dtype=


@pytest.mark.parametrize(
    "dtype", ["int32", jnp.int8, "bool", "uint8", "float8_e4m3fn", "float64", "complex64", "no-such-dtype"]
)
@pytest.mark.parametrize("api", ["load_transformer", "load_params"])
def test_dtype_must_be_a_float_compute_dtype(api, dtype, monkeypatch):
    forbid_tensor_reads(monkeypatch)
    src = flux_tiny.diffusers_folder(False)
    with pytest.raises(ValueError, match=r"not a floating-point dtype.*float32, bfloat16, float16"):
        if api == "load_transformer":
            load_transformer(src, dtype=dtype)
        else:
            load_params(src, single_device_mesh(), dtype)


def test_convert_refuses_integer_dtype_and_writes_nothing(tmp_path, monkeypatch):
    forbid_tensor_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"dtype=int16 is not a floating-point dtype"):
        convert_checkpoint(flux_tiny.diffusers_folder(False), tmp_path / "out", dtype="int16")
    assert listing(tmp_path) == []


# ------------------------------------------------------------------------------------------- orbax


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The tiny schnell model converted once; each test damages its own copy."""
    return convert_checkpoint(flux_tiny.diffusers_folder(False), tmp_path_factory.mktemp("orbax") / "ckpt")


@pytest.fixture(scope="module")
def array_names(converted) -> set[str]:
    _, model = load_params(converted, single_device_mesh())
    from flax import nnx

    return {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _flip_byte(ckpt: Path) -> None:
    file = largest_data_file(ckpt)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x40
    file.write_bytes(bytes(data))


def _truncate(ckpt: Path) -> None:
    file = largest_data_file(ckpt)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _empty(ckpt: Path) -> None:
    largest_data_file(ckpt).write_bytes(b"")


def _delete(ckpt: Path) -> None:
    largest_data_file(ckpt).unlink()


def _more_layers(ckpt: Path) -> None:
    meta = json.loads((ckpt / "jaxdit.json").read_text())
    meta["config"]["depth"] += 1
    (ckpt / "jaxdit.json").write_text(json.dumps(meta))


def _orbax_metadata(ckpt: Path) -> None:
    (ckpt / "params" / "_METADATA").write_text("{not json")


# (name, damage, names an array): every case is one CheckpointError of one line.
DAMAGE = [
    ("flipped-byte", _flip_byte, True),
    ("truncated-data-file", _truncate, True),
    ("empty-data-file", _empty, True),
    ("deleted-data-file", _delete, True),
    ("config-with-more-layers", _more_layers, True),
    ("orbax-metadata-garbage", _orbax_metadata, False),
]


@pytest.mark.parametrize(("name", "damage", "names_array"), DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damaged_converted_checkpoint_is_a_checkpoint_error(
    name, damage, names_array, converted, array_names, tmp_path
):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted, ckpt)
    damage(ckpt)
    with pytest.raises(CheckpointError, match=r"ckpt") as info:
        load_params(ckpt, single_device_mesh())
    message = str(info.value)
    assert len(message.splitlines()) == 1 and len(message) < 700, message
    if names_array:
        assert any(f"'{n}'" in message for n in array_names), message


def test_flipped_byte_found_when_restored_sharded(converted, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted, ckpt)
    _flip_byte(ckpt)
    with pytest.raises(CheckpointError, match=r"'[\w.]+'"):
        load_params(ckpt, ParallelConfig(tensor=4, ulysses=2).make_mesh())


def _save_raw(dst: Path, params: dict, dtype: str) -> Path:
    """A checkpoint written by orbax_io.save directly, bypassing the checks of loading a source."""
    return orbax_io.save(
        dst, params, {"family": "flux", "dtype": dtype, "config": flux_tiny.config(False).to_json()}
    )


def _params_of(converted: Path) -> dict:
    _, model = load_params(converted, single_device_mesh())
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_nan_in_converted_checkpoint_is_named(converted, tmp_path):
    params = _params_of(converted)
    params["final_layer"]["linear"]["kernel"] = (
        params["final_layer"]["linear"]["kernel"].at[0, 1].set(jnp.nan)
    )
    ckpt = _save_raw(tmp_path / "nan", params, "float32")
    with pytest.raises(CheckpointError, match=r"final_layer.linear.kernel \(float32\): 1 NaN"):
        load_params(ckpt, single_device_mesh())


def test_integer_array_in_converted_checkpoint_is_refused(converted, tmp_path, monkeypatch):
    params = _params_of(converted)
    params["final_layer"]["linear"]["bias"] = params["final_layer"]["linear"]["bias"].astype(jnp.int32)
    ckpt = _save_raw(tmp_path / "int", params, "float32")
    forbid_orbax_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"'final_layer.linear.bias' is stored as int32"):
        load_params(ckpt, single_device_mesh())


def test_tampered_checksum_is_reported(converted, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted, ckpt)
    meta = json.loads((ckpt / "jaxdit.json").read_text())
    name = "final_layer.linear.kernel"
    meta["arrays"][name]["checksum"] = f"{int(meta['arrays'][name]['checksum'], 16) ^ 1:08x}"
    (ckpt / "jaxdit.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=rf"'{name}' \(recorded [0-9a-f]{{8}}, read [0-9a-f]{{8}}\)"):
        load_params(ckpt, single_device_mesh())


@pytest.mark.parametrize("damage", [_flip_byte, _truncate], ids=["flipped-byte", "truncated-data-file"])
def test_convert_from_damaged_converted_checkpoint_writes_nothing(damage, converted, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(converted, src)
    damage(src)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointError, match=r"'[\w.]+'"):
        convert_checkpoint(src, out / "again", dtype="bfloat16")
    assert listing(out) == []


@pytest.mark.parametrize(
    "case", [c for c in FLUX_CASES if c.name in ("nan-weight", "int32-tensor")], ids=lambda c: c.name
)
def test_convert_from_bad_source_writes_nothing(case, tmp_path):
    src = variant(flux_tiny.diffusers_folder(False), tmp_path / "src", case.edit)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointError, match=case.match):
        convert_checkpoint(src, out / "converted")
    assert listing(out) == []
