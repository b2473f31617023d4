"""A checkpoint of several safetensors shard files seen as one, and opening a checkpoint from a path.

FLUX.1 and Wan checkpoints are often split over shard files named by a diffusers/transformers
``*.safetensors.index.json`` (``weight_map``: tensor name -> file name). ``CheckpointFiles`` has the
``SafetensorsFile`` interface over all of them and checks that the index and the files agree;
``open_checkpoint`` takes one file, an index, or a folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import CheckpointError, CheckpointKeyError
from converters.fp8_files import dequantized
from converters.lazy_tensor import LazyTensor
from converters.safetensors_file import SafetensorsFile
from converters.safetensors_header import TensorInfo, _reject_duplicates

__all__ = ["CheckpointFiles", "open_checkpoint"]

PathLike = str | os.PathLike[str]


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
    ``*.safetensors`` files (all used). FP8 checkpoints (ComfyUI's, plain or scaled) read as the
    higher-precision tensors they stand for (``converters.fp8_files``).
    """
    return dequantized(_open_files(path))


def _open_files(path: PathLike) -> CheckpointFiles:
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
