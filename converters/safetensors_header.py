"""The safetensors format: its dtype tags, the header, and the header's strict validation.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name -> dtype, shape,
``data_offsets``; an optional ``__metadata__`` of strings), then the raw bytes of every tensor
(https://github.com/huggingface/safetensors, README, "Format"). Offsets in ``data_offsets`` are relative
to the first byte after the header. The checks here are what make a damaged or foreign file fail at open
time with a message naming the file and the tensor, instead of reading garbage later: ``SafetensorsFile``
(``safetensors_file.py``) runs them before mapping anything; the writer (``safetensors_write.py``) shares
the dtype table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from converters.errors import CheckpointError

__all__ = ["TensorInfo", "parse_header", "read_header"]

# safetensors dtype tag -> numpy dtype. Standard numpy types are spelled little-endian explicitly; the
# ml_dtypes ones are native-endian, which is little-endian on every host we run on.
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_TAGS: dict[np.dtype, str] = {dt.newbyteorder("="): tag for tag, dt in _DTYPES.items()}

_HEADER_LEN_BYTES = 8
# The reference implementation refuses headers above 100 MB; a FLUX header is about 100 KB. Without a cap
# a corrupt length field could make us read gigabytes of tensor data as "JSON".
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in its file. ``begin``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: np.dtype
    dtype_tag: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: Path, f: Any, file_size: int) -> tuple[int, bytes]:
    """The header length field and the header bytes, checked against the file size and the cap."""
    if file_size < _HEADER_LEN_BYTES:
        raise CheckpointError(
            f"{path}: file is {file_size} bytes, too short for the 8-byte safetensors header length"
        )
    header_len = int.from_bytes(f.read(_HEADER_LEN_BYTES), "little")
    if header_len > file_size - _HEADER_LEN_BYTES:
        raise CheckpointError(
            f"{path}: header length {header_len} is beyond the file size ({file_size} bytes); "
            "the file is truncated or not a safetensors file"
        )
    if header_len > _MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path}: header length {header_len} exceeds the {_MAX_HEADER_BYTES}-byte limit; "
            "not a safetensors file"
        )
    header = f.read(header_len)
    if len(header) != header_len:
        raise CheckpointError(f"{path}: short read of the {header_len}-byte header")
    return header_len, header


def parse_header(
    path: Path, header: bytes, header_len: int, file_size: int
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The header JSON -> (tensor name -> ``TensorInfo``, ``__metadata__``), every rule of the format checked:
    entries well formed, known dtypes, ``data_offsets`` matching dtype x shape and tiling the data section
    exactly (no overlap, hole or trailing bytes). ``CheckpointError`` names the file and the tensor."""
    where = f"{path}"
    try:
        parsed = json.loads(header.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{where}: header is not valid UTF-8 JSON ({e})") from e
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{where}: header is a JSON {type(parsed).__name__}, not an object")

    metadata = parsed.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(f"{where}: __metadata__ must map strings to strings, got {metadata!r}")

    data_start = _HEADER_LEN_BYTES + header_len
    data_len = file_size - data_start
    infos: dict[str, TensorInfo] = {}
    for name, entry in parsed.items():
        what = f"{where}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{what}: header entry is not an object: {entry!r}")
        missing = {"dtype", "shape", "data_offsets"} - entry.keys()
        if missing:
            raise CheckpointError(f"{what}: header entry lacks {sorted(missing)}")
        tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if tag not in _DTYPES:
            raise CheckpointError(f"{what}: unknown dtype {tag!r}; supported: {', '.join(_DTYPES)}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{what}: shape {shape!r} is not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(
                f"{what}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end"
            )
        dtype = _DTYPES[tag]
        expected = math.prod(shape) * dtype.itemsize
        begin, end = offsets
        if end - begin != expected:
            raise CheckpointError(
                f"{what}: data_offsets [{begin}, {end}] span {end - begin} bytes, but {tag} {shape} "
                f"needs {expected}"
            )
        if end > data_len:
            raise CheckpointError(
                f"{what}: data ends at byte {end} of the data section, but the file holds only "
                f"{max(data_len, 0)} data bytes ({file_size} bytes in all, {data_start + end} needed); "
                "the file is truncated or its header is corrupt"
            )
        infos[name] = TensorInfo(name, dtype, tag, tuple(shape), data_start + begin, data_start + end)

    # The data section must be tiled exactly: every writer packs tensors back to back, so overlap, a
    # hole or trailing bytes mean a corrupt header (or two files pasted together), not a quirk.
    pos, prev = data_start, None
    for info in sorted(infos.values(), key=lambda i: (i.begin, i.end)):
        if info.begin < pos:
            raise CheckpointError(
                f"{where}: tensor {info.name!r} (bytes {info.begin}-{info.end}) overlaps tensor "
                f"{prev!r} (which ends at byte {pos})"
            )
        if info.begin > pos:
            raise CheckpointError(
                f"{where}: {info.begin - pos} bytes before tensor {info.name!r} belong to no tensor"
            )
        pos, prev = info.end, info.name
    if pos != file_size:
        raise CheckpointError(
            f"{where}: {file_size - pos} bytes after the last tensor belong to no tensor "
            f"(data ends at byte {pos}, file is {file_size} bytes)"
        )
    return infos, metadata
