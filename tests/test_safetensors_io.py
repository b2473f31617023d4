"""Tests for converters/safetensors_io.py: the torch-free safetensors reader, writer and mesh placement.

Round trips are checked bit for bit against the reference ``safetensors`` package (numpy and torch
writers and readers); every kind of damage a download or a bad export can do must surface as a
CheckpointError that names the file; placement is checked on a 2 x 4 mesh of emulated CPU devices.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from converters.errors import CheckpointError, CheckpointKeyError
from converters.safetensors_io import (
    CheckpointFiles,
    LazyTensor,
    SafetensorsFile,
    concatenate,
    load,
    narrow,
    open_checkpoint,
    place,
    transpose,
    write_safetensors,
)

REPO = Path(__file__).resolve().parents[1]


def _rng() -> np.random.Generator:
    return np.random.default_rng(0)


def _bits(a: np.ndarray) -> np.ndarray:
    """The raw bytes of an array, so comparisons are bit-exact (NaNs and -0.0 included)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _assert_bit_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _numpy_tensors() -> dict[str, np.ndarray]:
    rng = _rng()
    return {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((7,)).astype(np.float16),
        "f64": rng.standard_normal((2, 2, 2)),
        "i64": rng.integers(-(2**40), 2**40, (4,), dtype=np.int64),
        "i32": rng.integers(-1000, 1000, (2, 3), dtype=np.int32),
        "u8": rng.integers(0, 256, (9,), dtype=np.uint8),
        "bool": rng.random((3, 1)) > 0.5,
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "blocks.0.attn.to_q.weight": rng.standard_normal((4, 4)).astype(np.float32),
    }


# --------------------------------------------------------------------------------------------------------
# Round trips against the reference implementation
# --------------------------------------------------------------------------------------------------------


def test_reads_files_written_by_safetensors_numpy(tmp_path: Path) -> None:
    tensors = _numpy_tensors()
    path = tmp_path / "ref.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "np", "note": "x"})
    with SafetensorsFile(path) as f:
        assert set(f.keys()) == set(tensors)
        assert len(f) == len(tensors)
        assert f.metadata == {"format": "np", "note": "x"}
        for name, want in tensors.items():
            assert name in f
            assert f.shape(name) == want.shape
            assert f.dtype(name) == want.dtype
            _assert_bit_equal(f.read(name), want)


def test_reads_torch_bf16_and_fp8_bit_exactly(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(6, 10, generator=g).to(torch.bfloat16),
        "bf16_special": torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40]).to(
            torch.bfloat16
        ),
        "fp8": torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn),
        "f32": torch.randn(3, generator=g),
        "i64": torch.arange(6).reshape(2, 3),
    }
    path = tmp_path / "torch.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    f = SafetensorsFile(path)
    assert f.metadata == {"format": "pt"}
    assert f.dtype("bf16") == np.dtype(ml_dtypes.bfloat16)  # bf16 stays bf16: no widening on read
    assert f.dtype("fp8") == np.dtype(ml_dtypes.float8_e4m3fn)
    for name, t in tensors.items():
        got = f.read(name)
        assert got.shape == tuple(t.shape)
        raw = t.contiguous().view(torch.uint8).numpy().reshape(-1)  # the bytes torch stored
        np.testing.assert_array_equal(_bits(got), raw, err_msg=name)
    # Values, too: bf16 -> fp32 is exact, so it must agree with torch's own widening.
    np.testing.assert_array_equal(f.read("bf16").astype(np.float32), tensors["bf16"].float().numpy())


def test_written_files_load_with_safetensors(tmp_path: Path) -> None:
    tensors = _numpy_tensors()
    path = write_safetensors(tmp_path / "out.safetensors", tensors, metadata={"format": "np"})
    loaded = safetensors.numpy.load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, want in tensors.items():
        _assert_bit_equal(loaded[name], want)
    with safetensors.safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": "np"}
    # The data section starts 8-byte aligned and every tensor sits at a multiple of its item size.
    f = SafetensorsFile(path)
    for name in f:
        info = f.info(name)
        assert info.begin % info.dtype.itemsize == 0, name


def test_written_bf16_loads_in_torch(tmp_path: Path) -> None:
    rng = _rng()
    bf16 = rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16)
    fp8 = rng.standard_normal((3,)).astype(ml_dtypes.float8_e4m3fn)
    path = write_safetensors(tmp_path / "bf16.safetensors", {"w": bf16, "s": fp8})
    loaded = safetensors.torch.load_file(str(path))
    assert loaded["w"].dtype == torch.bfloat16
    assert loaded["s"].dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(loaded["w"].view(torch.uint8).numpy().reshape(-1), _bits(bf16))
    np.testing.assert_array_equal(loaded["s"].view(torch.uint8).numpy().reshape(-1), _bits(fp8))
    _assert_bit_equal(SafetensorsFile(path).read("w"), bf16)


def test_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "model.safetensors"
    old = {"a": np.arange(4, dtype=np.float32)}
    write_safetensors(path, old)
    before = path.read_bytes()

    # A failure before the rename leaves the old file whole and no temp file behind.
    def broken_fsync(fd: int) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk on fire"):
        write_safetensors(path, {"a": np.zeros(1000, dtype=np.float32)})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]

    # A successful write replaces it, again with no temp file left.
    write_safetensors(path, {"b": np.ones(3, dtype=np.int32)})
    assert SafetensorsFile(path).keys() == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="complex"):
        write_safetensors(tmp_path / "x.safetensors", {"c": np.zeros(2, dtype=np.complex64)})
    with pytest.raises(ValueError, match="__metadata__"):
        write_safetensors(tmp_path / "x.safetensors", {"__metadata__": np.zeros(2)})
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------------------------------------
# Slicing and laziness
# --------------------------------------------------------------------------------------------------------


def test_read_slices(tmp_path: Path) -> None:
    w = _rng().standard_normal((10, 6, 4)).astype(ml_dtypes.bfloat16)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": w})
    f = SafetensorsFile(path)
    _assert_bit_equal(f.read("w", (slice(2, 5),)), w[2:5])
    _assert_bit_equal(f.read("w", (slice(None), slice(1, 3), slice(0, 4, 2))), w[:, 1:3, 0:4:2])
    _assert_bit_equal(f.read("w", (3,)), w[3])
    out = f.read("w", (slice(0, 2),))
    out[...] = 0  # a fresh array, not a view of the read-only map
    v = f.view("w")
    assert not v.flags.writeable
    assert not v.flags.owndata
    _assert_bit_equal(f.tensor("w")[1:4, 2:5], w[1:4, 2:5])


def test_leading_slice_reads_only_its_rows(tmp_path: Path) -> None:
    """A 1 GiB tensor in a sparse file: reading 16 rows must not page in the rest (peak RSS stays low)."""
    rows, cols = 262_144, 1024  # 1 GiB of F32
    header = json.dumps(
        {"big": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, rows * cols * 4]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + rows * cols * 4)  # sparse: no blocks written
    # A fresh interpreter, so the peak RSS is not hidden by what earlier tests allocated.
    script = textwrap.dedent(
        f"""
        import resource, numpy as np
        from converters.safetensors_io import SafetensorsFile
        f = SafetensorsFile({str(path)!r})
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        a = f.read("big", (slice(1000, 1016),))
        b = f.tensor("big")[5000:5016, 0:512]
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert a.shape == (16, 1024) and b.shape == (16, 512) and not a.any()
        print((after - before) // 1024)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    grew_mib = int(out.stdout.strip())
    assert grew_mib < 64, f"reading 16 rows grew peak RSS by {grew_mib} MiB"


def test_lazy_views_match_numpy() -> None:
    rng = _rng()
    a = rng.standard_normal((6, 8, 4)).astype(np.float32)
    b = rng.standard_normal((6, 3, 4)).astype(np.float32)
    cases = {
        "transpose": (transpose(a, (2, 0, 1)), np.transpose(a, (2, 0, 1))),
        "narrow": (narrow(a, 1, 2, 7), a[:, 2:7]),
        "narrow_negative_axis": (narrow(a, -1, 1, 3), a[..., 1:3]),
        "concatenate": (concatenate([a, b, a], axis=1), np.concatenate([a, b, a], axis=1)),
        # norm_out's scale/shift swap and a transposed q out of a fused qkv, as converter hooks build them
        "swap_halves": (concatenate([narrow(a, 1, 4, 8), narrow(a, 1, 0, 4)], 1), np.roll(a, 4, axis=1)),
        "qkv_q_t": (transpose(narrow(a, 1, 0, 4), (1, 0, 2)), np.transpose(a[:, :4], (1, 0, 2))),
    }
    for name, (lazy, want) in cases.items():
        assert lazy.shape == want.shape, name
        np.testing.assert_array_equal(lazy[()], want, err_msg=name)
        for _ in range(20):
            box = tuple(
                slice(int(lo), int(hi)) for lo, hi in (np.sort(rng.integers(0, d + 1, 2)) for d in want.shape)
            )
            np.testing.assert_array_equal(lazy[box], want[box], err_msg=f"{name} {box}")
    with pytest.raises(ValueError, match="permutation"):
        transpose(a, (0, 0, 1))
    with pytest.raises(ValueError, match="out of range"):
        narrow(a, 0, 3, 9)
    with pytest.raises(ValueError, match="concatenate"):
        concatenate([a, b], axis=0)


# --------------------------------------------------------------------------------------------------------
# Several files
# --------------------------------------------------------------------------------------------------------


def _write_sharded(folder: Path, index_name: str = "diffusion_pytorch_model.safetensors.index.json") -> dict:
    rng = _rng()
    shards = {
        "diffusion_pytorch_model-00001-of-00002.safetensors": {
            "a.weight": rng.standard_normal((4, 3)).astype(ml_dtypes.bfloat16),
            "a.bias": rng.standard_normal((4,)).astype(np.float32),
        },
        "diffusion_pytorch_model-00002-of-00002.safetensors": {
            "b.weight": rng.standard_normal((2, 2)).astype(np.float16),
        },
    }
    weight_map = {}
    for name, tensors in shards.items():
        write_safetensors(folder / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 42}, "weight_map": weight_map}
    (folder / index_name).write_text(json.dumps(index))
    return {k: v for tensors in shards.values() for k, v in tensors.items()} | {"_shards": shards}


def test_sharded_index_folder(tmp_path: Path) -> None:
    want = _write_sharded(tmp_path)
    shards = want.pop("_shards")
    for ckpt in (
        open_checkpoint(tmp_path),
        open_checkpoint(tmp_path / "diffusion_pytorch_model.safetensors.index.json"),
        CheckpointFiles.from_index(tmp_path / "diffusion_pytorch_model.safetensors.index.json"),
    ):
        assert set(ckpt.keys()) == set(want)
        assert len(ckpt) == 3 and "a.bias" in ckpt and "nope" not in ckpt
        assert ckpt.metadata == {"total_size": 42}
        for shard, tensors in shards.items():
            for key, value in tensors.items():
                assert ckpt.file_of(key) == tmp_path / shard
                assert ckpt.shape(key) == value.shape
                assert ckpt.dtype(key) == value.dtype
                _assert_bit_equal(ckpt.read(key), value)
        _assert_bit_equal(ckpt.read("a.weight", (slice(1, 3),)), want["a.weight"][1:3])


def test_plain_file_list_and_folder(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "one.safetensors", {"x": np.ones(2, np.float32)}, {"format": "pt"})
    write_safetensors(tmp_path / "two.safetensors", {"y": np.zeros(3, np.int64)})
    ckpt = CheckpointFiles([tmp_path / "one.safetensors", tmp_path / "two.safetensors"])
    assert ckpt.keys() == ["x", "y"]
    np.testing.assert_array_equal(ckpt.read("y"), np.zeros(3, np.int64))
    assert set(open_checkpoint(tmp_path).keys()) == {"x", "y"}
    single = open_checkpoint(tmp_path / "one.safetensors")
    assert single.keys() == ["x"] and single.metadata == {"format": "pt"}


def test_key_in_two_files_is_an_error(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "one.safetensors", {"x": np.ones(2, np.float32)})
    write_safetensors(tmp_path / "two.safetensors", {"x": np.ones(2, np.float32)})
    with pytest.raises(CheckpointError, match="'x' is in two files") as e:
        CheckpointFiles([tmp_path / "one.safetensors", tmp_path / "two.safetensors"])
    assert "one.safetensors" in str(e.value) and "two.safetensors" in str(e.value)


def test_missing_key_names_the_checkpoint(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", {"x": np.ones(2, np.float32)})
    with pytest.raises(CheckpointKeyError, match="no tensor 'y'") as e:
        SafetensorsFile(path).read("y")
    assert str(path) in str(e.value)
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)
    _write_sharded(tmp_path / "sharded")
    with pytest.raises(KeyError, match="index.json: no tensor 'zzz'"):
        open_checkpoint(tmp_path / "sharded").shape("zzz")


def test_index_with_missing_shard(tmp_path: Path) -> None:
    _write_sharded(tmp_path)
    (tmp_path / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing") as e:
        open_checkpoint(tmp_path)
    assert "diffusion_pytorch_model-00002-of-00002.safetensors (1 tensors)" in str(e.value)
    assert "index.json" in str(e.value)


def test_index_disagreeing_with_its_files(tmp_path: Path) -> None:
    _write_sharded(tmp_path)
    index_path = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())

    # The index puts a key in the wrong file.
    moved = json.loads(json.dumps(index))
    moved["weight_map"]["b.weight"] = "diffusion_pytorch_model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(moved))
    with pytest.raises(CheckpointError, match="'b.weight'") as e:
        open_checkpoint(tmp_path)
    assert "00001-of-00002.safetensors" in str(e.value)

    # A file holds a key the index does not list.
    dropped = json.loads(json.dumps(index))
    del dropped["weight_map"]["a.bias"]
    index_path.write_text(json.dumps(dropped))
    with pytest.raises(CheckpointError, match="does not list.*'a.bias'"):
        open_checkpoint(tmp_path)

    # The index is not JSON, or has no weight_map.
    index_path.write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read the index"):
        open_checkpoint(tmp_path)
    index_path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        open_checkpoint(tmp_path)


# --------------------------------------------------------------------------------------------------------
# Corrupt files: every one a CheckpointError that names the file
# --------------------------------------------------------------------------------------------------------


def _raw_file(path: Path, header: object, data: bytes, header_len: int | None = None) -> Path:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(body) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + body + data)
    return path


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _good_file(path: Path) -> Path:
    return write_safetensors(
        path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int64)}
    )


def _truncate(path: Path, nbytes: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-nbytes])


CORRUPTIONS = {
    "truncated_by_one_byte": (lambda p: _truncate(_good_file(p), 1), "truncated"),
    "truncated_by_many_bytes": (lambda p: _truncate(_good_file(p), 20), "truncated"),
    "truncated_into_header": (
        lambda p: p.write_bytes(_good_file(p).read_bytes()[:30]),
        "beyond the file size",
    ),
    "shorter_than_length_field": (lambda p: p.write_bytes(b"\x01\x02"), "too short"),
    "garbage_header": (lambda p: _raw_file(p, b"\x93garbage\xff{{", b""), "not valid UTF-8 JSON"),
    "invalid_json": (lambda p: _raw_file(p, b'{"a": {"dtype": ', b""), "not valid UTF-8 JSON"),
    "header_not_object": (lambda p: _raw_file(p, [1, 2], b""), "not an object"),
    "header_length_too_big": (lambda p: _raw_file(p, {}, b"", header_len=10**6), "beyond the file size"),
    "header_length_huge": (lambda p: _raw_file(p, {}, b"", header_len=2**63), "beyond the file size"),
    "duplicate_key": (
        lambda p: _raw_file(
            p,
            b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
            b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
            b"\x00",
        ),
        "duplicate key 'a'",
    ),
    "overlapping_offsets": (
        lambda p: _raw_file(p, {"a": _entry("F32", [4], 0, 16), "b": _entry("F32", [4], 8, 24)}, bytes(24)),
        "overlaps",
    ),
    "same_offsets_twice": (
        lambda p: _raw_file(p, {"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 0, 8)}, bytes(8)),
        "overlaps",
    ),
    "offsets_disagree_with_shape": (
        lambda p: _raw_file(p, {"a": _entry("F32", [3], 0, 8)}, bytes(8)),
        r"tensor 'a'.*needs 12",
    ),
    "offsets_out_of_range": (
        lambda p: _raw_file(p, {"a": _entry("F32", [4], 8, 24)}, bytes(16)),
        r"tensor 'a'.*truncated",
    ),
    "offsets_reversed": (lambda p: _raw_file(p, {"a": _entry("U8", [0], 4, 2)}, bytes(4)), "begin <= end"),
    "negative_offset": (lambda p: _raw_file(p, {"a": _entry("U8", [2], -2, 0)}, bytes(2)), "tensor 'a'"),
    "unknown_dtype": (
        lambda p: _raw_file(p, {"a": _entry("C64", [1], 0, 8)}, bytes(8)),
        "unknown dtype 'C64'",
    ),
    "bad_shape": (lambda p: _raw_file(p, {"a": _entry("U8", [-1], 0, 0)}, b""), "shape"),
    "missing_field": (lambda p: _raw_file(p, {"a": {"dtype": "U8", "shape": [1]}}, b"\x00"), "data_offsets"),
    "hole_between_tensors": (
        lambda p: _raw_file(p, {"a": _entry("U8", [2], 0, 2), "b": _entry("U8", [2], 4, 6)}, bytes(6)),
        "belong to no tensor",
    ),
    "trailing_bytes": (
        lambda p: _raw_file(p, {"a": _entry("U8", [2], 0, 2)}, bytes(5)),
        "after the last tensor",
    ),
    "bad_metadata": (lambda p: _raw_file(p, {"__metadata__": {"a": 1}}, b""), "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_file_is_a_checkpoint_error_naming_the_file(tmp_path: Path, case: str) -> None:
    make, message = CORRUPTIONS[case]
    path = tmp_path / f"{case}.safetensors"
    make(path)
    with pytest.raises(CheckpointError, match=message) as e:
        SafetensorsFile(path)
    assert str(path) in str(e.value)
    # And the same through a multi-file view.
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(path)


def test_corrupt_file_inside_an_index(tmp_path: Path) -> None:
    _write_sharded(tmp_path)
    shard = tmp_path / "diffusion_pytorch_model-00002-of-00002.safetensors"
    _truncate(shard, 3)
    with pytest.raises(CheckpointError, match="truncated") as e:
        open_checkpoint(tmp_path)
    assert str(shard) in str(e.value)


def test_header_only_file(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "empty.safetensors", {}, metadata={"k": "v"})
    f = SafetensorsFile(path)
    assert f.keys() == [] and f.metadata == {"k": "v"}
    assert safetensors.numpy.load_file(str(path)) == {}


# --------------------------------------------------------------------------------------------------------
# Placement onto a device mesh
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    assert jax.device_count() >= 8, (
        "needs 8 devices: tests/conftest.py (or XLA_FLAGS=--xla_force_host_platform_device_count=8) "
        "must set them before jax starts"
    )
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))


class _CountingTensor(LazyTensor):
    """Wraps an array and records every box read from it."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.shape = array.shape
        self.dtype = array.dtype
        self.boxes: list[tuple[tuple[int, int], ...]] = []

    def _read(self, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        self.boxes.append(box)
        return self.array[tuple(slice(a, b) for a, b in box)].copy()


def _check_shards(arr: jax.Array, want: np.ndarray, shard_shape: tuple[int, ...]) -> None:
    np.testing.assert_array_equal(np.asarray(arr), want)
    assert len(arr.addressable_shards) == 8
    for shard in arr.addressable_shards:
        assert shard.data.shape == shard_shape
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def test_place_bf16_checkpoint_sharded(tmp_path: Path, mesh: Mesh) -> None:
    w = _rng().standard_normal((8, 16)).astype(ml_dtypes.bfloat16)
    f = SafetensorsFile(write_safetensors(tmp_path / "w.safetensors", {"w": w}))
    sharding = NamedSharding(mesh, P("a", "b"))

    kept = load(f, "w", sharding)
    assert kept.dtype == jax.numpy.bfloat16  # no dtype: bf16 stays bf16
    assert kept.sharding == sharding
    _check_shards(kept, w, (4, 4))

    widened = load(f, "w", sharding, dtype=np.float32)
    assert widened.dtype == np.float32
    _check_shards(widened, w.astype(np.float32), (4, 4))


def test_place_reads_each_distinct_box_once(mesh: Mesh) -> None:
    a = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    for spec, n_boxes, shard_shape in [
        (P("a", "b"), 8, (4, 3)),  # every device its own box
        (P("a", None), 2, (4, 12)),  # each half replicated over 4 devices: read twice, not 8 times
        (P(None, "b"), 4, (8, 3)),
        (P(), 1, (8, 12)),  # fully replicated: one read
    ]:
        src = _CountingTensor(a)
        arr = place(src, NamedSharding(mesh, spec), dtype=jax.numpy.bfloat16)
        assert arr.dtype == jax.numpy.bfloat16
        _check_shards(arr, a.astype(ml_dtypes.bfloat16), shard_shape)
        assert len(src.boxes) == n_boxes, (spec, src.boxes)
        assert len(set(src.boxes)) == n_boxes
        # Each box read is exactly one device's shard, never the whole tensor (unless replicated).
        assert all(tuple(b - a for a, b in box) == shard_shape for box in src.boxes)


def test_place_lazy_views_and_transform(tmp_path: Path, mesh: Mesh) -> None:
    rng = _rng()
    qkv = rng.standard_normal((24, 8)).astype(ml_dtypes.bfloat16)  # torch Linear [out, in], q|k|v fused
    f = SafetensorsFile(write_safetensors(tmp_path / "qkv.safetensors", {"qkv": qkv}))
    sharding = NamedSharding(mesh, P("a", "b"))

    # q's kernel in [in, out] layout, out (heads) sharded over 'b': each device reads its rows of q only.
    q_kernel = transpose(narrow(f.tensor("qkv"), 0, 0, 8), (1, 0))
    arr = place(q_kernel, sharding, dtype=np.float32)
    _check_shards(arr, qkv[:8].T.astype(np.float32), (4, 2))

    swapped = concatenate([narrow(f.tensor("qkv"), 0, 12, 24), narrow(f.tensor("qkv"), 0, 0, 12)])
    arr = place(swapped, sharding, transform=lambda x: x * 2)
    want = np.concatenate([qkv[12:], qkv[:12]]) * 2
    _check_shards(arr, want, (12, 2))

    # A plain numpy array is a source, too.
    _check_shards(place(qkv, sharding), qkv, (12, 2))

    with pytest.raises(ValueError, match="must keep the shape"):
        place(f.tensor("qkv"), sharding, transform=lambda x: x[:1])
