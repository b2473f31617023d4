"""One safetensors file, memory-mapped and validated, read without torch.

Opening reads and checks only the header (``safetensors_header.py``), then maps the file; nothing else
is read until a tensor, or a slice of one, is asked for, and a slice along the leading axis touches only
its rows. bf16 and fp8 stay bf16 and fp8 (``ml_dtypes``): no silent widening and no torch import. Data
is little-endian; like safetensors itself, this assumes a little-endian host.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import CheckpointError, CheckpointKeyError
from converters.lazy_tensor import Box, LazyTensor, _box_slices
from converters.safetensors_header import TensorInfo, parse_header, read_header

__all__ = ["SafetensorsFile"]

PathLike = str | os.PathLike[str]


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
                header_len, header = read_header(self.path, f, file_size)
                self._infos, self.metadata = parse_header(self.path, header, header_len, file_size)
                self._order = sorted(self._infos, key=lambda k: self._infos[k].begin)
                # mmap of an empty region is an error; a file with only a header has nothing to map.
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self._infos else None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open safetensors file: {e}") from e
        self._buf = np.frombuffer(self._mmap, dtype=np.uint8) if self._mmap is not None else None
        self.file_size = file_size

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
