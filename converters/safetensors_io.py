"""Reading and writing safetensors checkpoints without torch, and placing tensors onto a device mesh.

FLUX.1 and Wan 2.1 checkpoints are 12-28 GB of safetensors, often split over several shard files with a
diffusers ``*.safetensors.index.json``. This module reads them so that no tensor, and never the whole
checkpoint, has to be held in host memory at once:

- ``SafetensorsFile`` parses the format itself (8-byte little-endian header length, a JSON header, then
  the raw bytes of every tensor), validates the header strictly, and memory-maps the file. Nothing is read
  until a tensor, or a slice of one, is asked for; a slice along the leading axis touches only its rows.
  bf16 and fp8 stay bf16 and fp8 (``ml_dtypes``), so there is no silent widening and no torch import.
- ``CheckpointFiles`` is the same interface over several shard files, from an index or a plain list.
- ``LazyTensor`` is a tensor not yet read: a checkpoint entry, or a transpose, sub-range or concatenation
  of others. Converter hooks (qkv split, scale/shift swap, kernel transposes) compose these lazily.
- ``place`` builds a sharded ``jax.Array`` with ``jax.make_array_from_callback``: each device reads
  only its own box of the tensor straight from the memory map, and a dtype cast happens per box, so a bf16
  checkpoint loads as fp32 without the full tensor ever existing in fp32 on the host.
- ``write_safetensors`` writes a file atomically (temp file in the same directory, fsync, rename), so an
  interrupted export never leaves a half-written checkpoint under the final name.

Format: https://github.com/huggingface/safetensors (README, "Format"). Offsets in ``data_offsets`` are
relative to the first byte after the header. Data is little-endian; like safetensors itself, this module
assumes a little-endian host.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from converters.errors import CheckpointError, CheckpointKeyError

if TYPE_CHECKING:
    import jax

__all__ = [
    "CheckpointFiles",
    "LazyTensor",
    "SafetensorsFile",
    "TensorInfo",
    "concatenate",
    "load",
    "narrow",
    "open_checkpoint",
    "place",
    "transpose",
    "write_safetensors",
]

PathLike = str | os.PathLike[str]
# A box of a tensor: one (start, stop) pair per axis, both concrete and in range.
Box = tuple[tuple[int, int], ...]

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
_WRITE_CHUNK_BYTES = 64 * 1024 * 1024


# --------------------------------------------------------------------------------------------------------
# Lazy tensors: boxes read on demand
# --------------------------------------------------------------------------------------------------------


def _resolve_index(index: Any, shape: tuple[int, ...]) -> Box:
    """Turn a tuple of unit-step slices (fewer than ndim allowed) into a concrete box."""
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape):
        raise IndexError(f"index {index!r} has {len(index)} entries for a tensor of shape {shape}")
    box = []
    for axis, dim in enumerate(shape):
        s = index[axis] if axis < len(index) else slice(None)
        if not isinstance(s, slice):
            raise TypeError(f"lazy tensors take slices only, got {s!r} on axis {axis}")
        start, stop, step = s.indices(dim)
        if step != 1:
            raise ValueError(f"lazy tensors take unit-step slices only, got {s!r} on axis {axis}")
        box.append((start, max(start, stop)))
    return tuple(box)


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def _box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


class LazyTensor:
    """A tensor that is read only when, and only as far as, it is indexed.

    ``t[index]`` takes a tuple of unit-step slices and returns a fresh numpy array (never a view of the
    memory map). Subclasses implement ``_read(box)``.
    """

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __getitem__(self, index: Any) -> np.ndarray:
        box = _resolve_index(index, self.shape)
        out = self._read(box)
        if out.shape != _box_shape(box):  # a broken subclass must not hand a device the wrong shape
            raise AssertionError(f"{self!r} read {out.shape} for box {box}")
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[()]
        return out if dtype is None else out.astype(dtype)

    def _read(self, box: Box) -> np.ndarray:
        raise NotImplementedError

    def children(self) -> tuple[LazyTensor, ...]:
        """The lazy tensors this one is computed from; none for a stored tensor.

        Views keep theirs in ``_source`` / ``_sources`` (subclasses elsewhere follow the same names)."""
        sources = getattr(self, "_sources", None)
        if sources is not None:
            return tuple(sources)
        source = getattr(self, "_source", None)
        return (source,) if isinstance(source, LazyTensor) else ()

    def stored(self) -> list[LazyTensor]:
        """The stored tensors (leaves with a ``key``) this one reads from, each once, in order."""
        out: dict[int, LazyTensor] = {}
        todo = [self]
        while todo:
            t = todo.pop()
            if getattr(t, "key", None) is not None:
                out.setdefault(id(t), t)
            todo.extend(reversed(t.children()))
        return list(out.values())


class _ArrayTensor(LazyTensor):
    """An in-memory array (e.g. computed by a converter hook) behind the lazy interface."""

    def __init__(self, array: Any) -> None:
        self._array = array
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)

    def _read(self, box: Box) -> np.ndarray:
        return np.array(self._array[_box_slices(box)])

    def __repr__(self) -> str:
        return f"_ArrayTensor(shape={self.shape}, dtype={self.dtype})"


def _as_lazy(source: Any) -> LazyTensor:
    if isinstance(source, LazyTensor):
        return source
    if hasattr(source, "shape") and hasattr(source, "dtype") and hasattr(source, "__getitem__"):
        return _ArrayTensor(source)
    return _ArrayTensor(np.asarray(source))


class _FileTensor(LazyTensor):
    def __init__(self, file: SafetensorsFile, key: str) -> None:
        info = file.info(key)
        self._file = file
        self.key = key
        self.origin = str(file.path)
        self.shape = info.shape
        self.dtype = info.dtype

    def _read(self, box: Box) -> np.ndarray:
        return self._file.read(self.key, _box_slices(box))

    def __repr__(self) -> str:
        return f"LazyTensor({self.key!r} in {self._file.path}, shape={self.shape}, dtype={self.dtype})"


class _Transposed(LazyTensor):
    def __init__(self, source: LazyTensor, axes: tuple[int, ...]) -> None:
        if sorted(axes) != list(range(source.ndim)):
            raise ValueError(f"axes {axes} are not a permutation of the {source.ndim} axes of {source!r}")
        self._source = source
        self._axes = axes
        self.shape = tuple(source.shape[a] for a in axes)
        self.dtype = source.dtype

    def _read(self, box: Box) -> np.ndarray:
        # Output axis i is source axis axes[i]: read the matching source box, then transpose that box.
        source_box = [(0, 0)] * len(box)
        for out_axis, src_axis in enumerate(self._axes):
            source_box[src_axis] = box[out_axis]
        return np.ascontiguousarray(np.transpose(self._source._read(tuple(source_box)), self._axes))

    def __repr__(self) -> str:
        return f"transpose({self._source!r}, {self._axes})"


class _Narrowed(LazyTensor):
    def __init__(self, source: LazyTensor, axis: int, start: int, stop: int) -> None:
        dim = source.shape[axis]
        if not 0 <= start <= stop <= dim:
            raise ValueError(f"narrow [{start}:{stop}] is out of range for axis {axis} of {source!r}")
        self._source = source
        self._axis = axis
        self._start = start
        shape = list(source.shape)
        shape[axis] = stop - start
        self.shape = tuple(shape)
        self.dtype = source.dtype

    def _read(self, box: Box) -> np.ndarray:
        source_box = list(box)
        start, stop = box[self._axis]
        source_box[self._axis] = (start + self._start, stop + self._start)
        return self._source._read(tuple(source_box))

    def __repr__(self) -> str:
        lo = self._start
        return f"narrow({self._source!r}, axis={self._axis}, {lo}:{lo + self.shape[self._axis]})"


class _Concatenated(LazyTensor):
    def __init__(self, sources: Sequence[LazyTensor], axis: int) -> None:
        if not sources:
            raise ValueError("concatenate needs at least one tensor")
        first = sources[0]
        for s in sources[1:]:
            other = s.shape[:axis] + s.shape[axis + 1 :]
            if s.ndim != first.ndim or other != first.shape[:axis] + first.shape[axis + 1 :]:
                raise ValueError(f"cannot concatenate {first!r} and {s!r} along axis {axis}")
            if s.dtype != first.dtype:
                raise ValueError(f"cannot concatenate {first!r} and {s!r}: dtypes differ")
        self._sources = tuple(sources)
        self._axis = axis
        self._offsets = np.cumsum([0] + [s.shape[axis] for s in sources]).tolist()
        shape = list(first.shape)
        shape[axis] = self._offsets[-1]
        self.shape = tuple(shape)
        self.dtype = first.dtype

    def _read(self, box: Box) -> np.ndarray:
        start, stop = box[self._axis]
        parts = []
        for source, lo, hi in zip(self._sources, self._offsets[:-1], self._offsets[1:], strict=True):
            a, b = max(start, lo), min(stop, hi)
            if a < b:  # only the sources this box overlaps are read
                sub = list(box)
                sub[self._axis] = (a - lo, b - lo)
                parts.append(source._read(tuple(sub)))
        if not parts:
            return np.empty(_box_shape(box), self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=self._axis)

    def __repr__(self) -> str:
        return f"concatenate({list(self._sources)!r}, axis={self._axis})"


def _axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for {ndim} dimensions")
    return axis % ndim


def transpose(source: Any, axes: Sequence[int]) -> LazyTensor:
    """Lazy ``np.transpose(source, axes)``: a box of the result reads only the matching source box."""
    src = _as_lazy(source)
    return _Transposed(src, tuple(_axis(a, src.ndim) for a in axes))


def narrow(source: Any, axis: int, start: int, stop: int) -> LazyTensor:
    """Lazy ``source[..., start:stop, ...]`` along ``axis`` (e.g. q out of a fused qkv weight)."""
    src = _as_lazy(source)
    return _Narrowed(src, _axis(axis, src.ndim), start, stop)


def concatenate(sources: Sequence[Any], axis: int = 0) -> LazyTensor:
    """Lazy ``np.concatenate(sources, axis)``; a box reads only the parts of the sources it overlaps."""
    srcs = [_as_lazy(s) for s in sources]
    if not srcs:
        raise ValueError("concatenate needs at least one tensor")
    return _Concatenated(srcs, _axis(axis, srcs[0].ndim))


# --------------------------------------------------------------------------------------------------------
# One safetensors file
# --------------------------------------------------------------------------------------------------------


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


class SafetensorsFile:
    """A memory-mapped, validated safetensors file.

    Opening reads and checks only the header; tensor bytes are touched when ``read`` (or a ``LazyTensor``
    from ``tensor``) asks for them. Raises ``CheckpointError`` naming the file and the tensor for a header
    length beyond the file, a header that is not a JSON object of well-formed entries, an unknown dtype,
    ``data_offsets`` that are out of range, overlap, leave holes or disagree with dtype x shape, and a file
    that is shorter (truncated) or longer than its last tensor's end.
    """

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                file_size = os.fstat(f.fileno()).st_size
                header_len, header = self._read_header(f, file_size)
                self._infos, self.metadata = self._parse_header(header, header_len, file_size)
                self._order = sorted(self._infos, key=lambda k: self._infos[k].begin)
                # mmap of an empty region is an error; a file with only a header has nothing to map.
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self._infos else None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open safetensors file: {e}") from e
        self._buf = np.frombuffer(self._mmap, dtype=np.uint8) if self._mmap is not None else None
        self.file_size = file_size

    def _read_header(self, f: Any, file_size: int) -> tuple[int, bytes]:
        if file_size < _HEADER_LEN_BYTES:
            raise CheckpointError(
                f"{self.path}: file is {file_size} bytes, too short for the 8-byte safetensors header length"
            )
        header_len = int.from_bytes(f.read(_HEADER_LEN_BYTES), "little")
        if header_len > file_size - _HEADER_LEN_BYTES:
            raise CheckpointError(
                f"{self.path}: header length {header_len} is beyond the file size ({file_size} bytes); "
                "the file is truncated or not a safetensors file"
            )
        if header_len > _MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{self.path}: header length {header_len} exceeds the {_MAX_HEADER_BYTES}-byte limit; "
                "not a safetensors file"
            )
        header = f.read(header_len)
        if len(header) != header_len:
            raise CheckpointError(f"{self.path}: short read of the {header_len}-byte header")
        return header_len, header

    def _parse_header(
        self, header: bytes, header_len: int, file_size: int
    ) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        where = f"{self.path}"
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

    # -- mapping-style API ------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, key: str) -> TensorInfo:
        try:
            return self._infos[key]
        except KeyError:
            raise CheckpointKeyError(f"{self.path}: no tensor {key!r}") from None

    def shape(self, key: str) -> tuple[int, ...]:
        return self.info(key).shape

    def dtype(self, key: str) -> np.dtype:
        return self.info(key).dtype

    def file_of(self, key: str) -> Path:
        self.info(key)
        return self.path

    def view(self, key: str) -> np.ndarray:
        """A read-only numpy view of the tensor on the memory map: no bytes are read until used."""
        info = self.info(key)
        if info.nbytes == 0:
            return np.empty(info.shape, info.dtype)
        if self._buf is None:
            raise CheckpointError(f"{self.path}: file is closed")
        return self._buf[info.begin : info.end].view(info.dtype).reshape(info.shape)

    def read(self, key: str, index: Any = None) -> np.ndarray:
        """The tensor (or ``view(key)[index]``) as a fresh numpy array in the file's dtype.

        Only the bytes of the selected elements are paged in: a slice along the leading axis reads just
        those rows.
        """
        v = self.view(key)
        return np.array(v if index is None else v[index])

    def tensor(self, key: str) -> LazyTensor:
        """The tensor as a ``LazyTensor`` for ``place``/``transpose``/``narrow``/``concatenate``."""
        return _FileTensor(self, key)

    def close(self) -> None:
        """Drop this object's hold on the memory map. Views still alive keep it mapped until freed."""
        self._buf = None
        self._mmap = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self)} tensors)"


# --------------------------------------------------------------------------------------------------------
# Several shard files
# --------------------------------------------------------------------------------------------------------


class CheckpointFiles:
    """Several safetensors files seen as one checkpoint, with the same API as ``SafetensorsFile``.

    Build it from a list of files (``CheckpointFiles(paths)``) or a diffusers/transformers index
    (``CheckpointFiles.from_index(path)``). A tensor name found in two files is an error naming both.
    """

    def __init__(self, paths: Sequence[PathLike], *, _index: Path | None = None) -> None:
        if isinstance(paths, str | os.PathLike):
            paths = [paths]
        if not paths:
            raise CheckpointError("no safetensors files given")
        self.index_path = _index
        self.files: tuple[SafetensorsFile, ...] = tuple(SafetensorsFile(p) for p in paths)
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for key in f:
                other = self._where.get(key)
                if other is not None:
                    raise CheckpointError(f"tensor {key!r} is in two files: {other.path} and {f.path}")
                self._where[key] = f
        self.metadata: dict[str, Any] = dict(self.files[0].metadata) if len(self.files) == 1 else {}

    @classmethod
    def from_index(cls, index_path: PathLike) -> CheckpointFiles:
        """Open the shards an ``*.safetensors.index.json`` names, checking every file exists and every
        tensor is in the file the index says (and no file holds a tensor the index does not list)."""
        index_path = Path(index_path)
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"), object_pairs_hook=_reject_duplicates)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{index_path}: cannot read the index: {e}") from e
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index_path}: index has no 'weight_map' of tensor name -> file name")

        by_file: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            by_file.setdefault(name, []).append(key)
        folder = index_path.parent
        missing = [name for name in by_file if not (folder / name).is_file()]
        if missing:
            raise CheckpointError(
                f"{index_path}: shard file(s) missing from {folder}: "
                + ", ".join(f"{name} ({len(by_file[name])} tensors)" for name in missing)
            )

        ckpt = cls([folder / name for name in by_file], _index=index_path)
        for f, keys in zip(ckpt.files, by_file.values(), strict=True):
            absent = [k for k in keys if k not in f]
            if absent:
                raise CheckpointError(
                    f"{f.path}: index {index_path.name} places {len(absent)} tensor(s) in this file that it "
                    f"does not hold, e.g. {absent[0]!r}"
                )
            listed = set(keys)
            extra = [k for k in f if k not in listed]
            if extra:
                raise CheckpointError(
                    f"{f.path}: holds {len(extra)} tensor(s) the index {index_path.name} does not list "
                    f"for this file, e.g. {extra[0]!r}"
                )
        metadata = index.get("metadata")
        ckpt.metadata = dict(metadata) if isinstance(metadata, dict) else {}
        return ckpt

    def _file(self, key: str) -> SafetensorsFile:
        try:
            return self._where[key]
        except KeyError:
            source = self.index_path or ", ".join(str(f.path) for f in self.files)
            raise CheckpointKeyError(f"{source}: no tensor {key!r}") from None

    def keys(self) -> list[str]:
        return [k for f in self.files for k in f]

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._where)

    def info(self, key: str) -> TensorInfo:
        return self._file(key).info(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._file(key).shape(key)

    def dtype(self, key: str) -> np.dtype:
        return self._file(key).dtype(key)

    def file_of(self, key: str) -> Path:
        return self._file(key).path

    def view(self, key: str) -> np.ndarray:
        return self._file(key).view(key)

    def read(self, key: str, index: Any = None) -> np.ndarray:
        return self._file(key).read(key, index)

    def tensor(self, key: str) -> LazyTensor:
        return self._file(key).tensor(key)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointFiles({len(self.files)} files, {len(self)} tensors)"


def open_checkpoint(path: PathLike) -> CheckpointFiles:
    """Open a checkpoint given as one ``.safetensors`` file, an ``*.index.json``, or a folder.

    A folder must hold exactly one ``*.safetensors.index.json`` (used), or no index and one or more
    ``*.safetensors`` files (all used).
    """
    path = Path(path)
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise CheckpointError(
                f"{path}: several indexes ({', '.join(i.name for i in indexes)}); pass the one to use"
            )
        if indexes:
            return CheckpointFiles.from_index(indexes[0])
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files and no *.safetensors.index.json")
        return CheckpointFiles(files)
    if path.name.endswith(".json"):
        return CheckpointFiles.from_index(path)
    return CheckpointFiles([path])


# --------------------------------------------------------------------------------------------------------
# Placement onto a device mesh
# --------------------------------------------------------------------------------------------------------


def place(
    source: Any,
    sharding: jax.sharding.Sharding,
    *,
    dtype: Any = None,
    transform: Callable[[np.ndarray], np.ndarray] | None = None,
) -> jax.Array:
    """Build a sharded ``jax.Array`` from ``source``, each device reading only its own box.

    Args:
      source: a ``LazyTensor`` (a checkpoint entry, or a ``transpose``/``narrow``/``concatenate`` of
        them) or any array-like with ``shape``, ``dtype`` and slicing (e.g. a numpy array).
      sharding: a ``jax.sharding.Sharding`` for an array of ``source.shape``.
      dtype: cast each box to this dtype after reading (and after ``transform``); the full tensor never
        exists in the wider dtype on the host.
      transform: applied to each box as read; must keep its shape (elementwise, e.g. a scale). Shape
        changing rearrangements belong in the lazy tensor, where they map boxes correctly.

    ``jax.make_array_from_callback`` asks once per addressable device, so a box shared by several
    devices (a partly replicated sharding) would be read several times; boxes are cached for the
    duration of the call, so each distinct box is read once.
    """
    import jax  # deferred: reading and writing files must not pay for (or configure) jax

    src = _as_lazy(source)
    out_dtype = np.dtype(dtype) if dtype is not None else src.dtype
    cache: dict[Box, np.ndarray] = {}

    def read_box(index: Any) -> np.ndarray:
        box = _resolve_index(index, src.shape)
        hit = cache.get(box)
        if hit is not None:
            return hit
        chunk = src[_box_slices(box)]
        if transform is not None:
            chunk = np.asarray(transform(chunk))
            if chunk.shape != _box_shape(box):
                raise ValueError(
                    f"transform changed a box of {src!r} from {_box_shape(box)} to {chunk.shape}; "
                    "it must keep the shape"
                )
        with np.errstate(over="ignore"):  # values beyond out_dtype's range: reported by place_params' check
            chunk = chunk.astype(out_dtype, copy=False)
        cache[box] = chunk
        return chunk

    return jax.make_array_from_callback(src.shape, sharding, read_box, dtype=out_dtype)


def load(
    checkpoint: SafetensorsFile | CheckpointFiles,
    key: str,
    sharding: jax.sharding.Sharding,
    *,
    dtype: Any = None,
    transform: Callable[[np.ndarray], np.ndarray] | None = None,
) -> jax.Array:
    """``place(checkpoint.tensor(key), sharding, ...)``: one checkpoint tensor onto the mesh."""
    return place(checkpoint.tensor(key), sharding, dtype=dtype, transform=transform)


# --------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------


def write_safetensors(
    path: PathLike, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``tensors`` to ``path`` in safetensors format, atomically.

    The bytes go to a temporary file in the destination folder, which is fsynced and then renamed over
    ``path``: a reader sees the old file or the complete new one, never a partial write. Tensors are laid
    out widest dtype first (then by name), which keeps every tensor aligned to its item size, as the
    reference writer does. Returns the path written.
    """
    path = Path(path)
    metadata = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must map str to str")

    arrays: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        arr = np.asarray(value)
        if arr.dtype.newbyteorder("=") not in _TAGS or (arr.dtype.byteorder == ">" and arr.itemsize > 1):
            raise TypeError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors equivalent")
        # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
        arrays[name] = arr if arr.flags.c_contiguous else arr.copy(order="C")

    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        arr = arrays[name]
        header[name] = {
            "dtype": _TAGS[arr.dtype.newbyteorder("=")],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad with spaces (valid JSON whitespace) so the data section starts 8-byte aligned.
    header_bytes += b" " * (-(len(header_bytes) + _HEADER_LEN_BYTES) % 8)

    path.parent.mkdir(parents=True, exist_ok=True)
    # os.open with mode 0o666 lets the umask decide the permissions, as a plain open() would (mkstemp
    # would make the final file 0600).
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(header_bytes).to_bytes(_HEADER_LEN_BYTES, "little"))
            f.write(header_bytes)
            for name in order:
                flat = arrays[name].reshape(-1).view(np.uint8)
                for start in range(0, flat.size, _WRITE_CHUNK_BYTES):
                    f.write(flat[start : start + _WRITE_CHUNK_BYTES].data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable. Best effort: some filesystems do not allow opening a directory."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
