"""FP8 checkpoints as people download them: the higher-precision tensors they stand for.

ComfyUI's FP8 files for FLUX and Wan store linear weights as ``float8_e4m3fn`` (or ``e5m2``), either
plain (the values cast, scale 1) or "scaled": each weight ``<layer>.weight`` comes with a
``<layer>.scale_weight`` tensor and the file holds an empty ``scaled_fp8`` marker. Other exporters write
the scale as ``<layer>.weight_scale``. :func:`dequantized` shows such a checkpoint with the same API as
:class:`~converters.checkpoint_files.CheckpointFiles`: FP8 weights read as float32 ``value * scale`` (box
by box, memory-mapped like any tensor), and the scale tensors and the marker consumed, so the family's
key tables see the layout they know. ``jaxdit generate --quantize fp8`` then stores them in FP8 again,
with jaxdit's per-channel scales.

Strict, like every reader here: a scale whose weight is missing or not FP8, or whose shape is neither a
scalar nor one value per output channel, is refused by name. Static activation scales (``scale_input``,
``input_scale``) are recognised and not used: jaxdit's FP8 matmuls scale activations per token at run time.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from converters.errors import CheckpointError
from converters.lazy_tensor import Box, LazyTensor

__all__ = ["FP8_DTYPES", "Fp8Files", "dequantized"]

FP8_DTYPES = frozenset({np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)})
#: Suffixes of a weight's scale, as ComfyUI and other exporters name it.
WEIGHT_SCALES = (".scale_weight", ".weight_scale")
#: Static activation scales: recognised, not needed (activations are scaled per token at run time).
INPUT_SCALES = (".scale_input", ".input_scale")
MARKER = "scaled_fp8"
#: The dtype FP8 weights are reported as (what ComfyUI's FP8 files were made from).
STANDS_FOR = np.dtype(ml_dtypes.bfloat16)


class _Dequantized(LazyTensor):
    """``source * scale`` in float32; ``scale``: a scalar or one value per output channel (axis 0)."""

    def __init__(self, source: LazyTensor, scale: np.ndarray) -> None:
        self._source = source
        self._scale = scale.astype(np.float32).reshape(-1)
        self.shape = source.shape
        self.dtype = np.dtype(np.float32)

    def _read(self, box: Box) -> np.ndarray:
        values = self._source._read(box).astype(np.float32)
        if self._scale.size == 1:
            return values * self._scale[0]
        start, stop = box[0]
        return values * self._scale[start:stop].reshape((-1,) + (1,) * (values.ndim - 1))

    def __repr__(self) -> str:
        return f"dequantized({self._source!r})"


class Fp8Files:
    """A checkpoint's files with FP8 weights dequantized and their scales consumed (see the module)."""

    def __init__(self, files: Any) -> None:
        self.inner = files
        self.scales: dict[str, str] = {}  # weight key -> its scale's key
        hidden: set[str] = set()
        keys = list(files.keys())
        for key in keys:
            if key == MARKER:
                hidden.add(key)
                continue
            suffix = next((s for s in WEIGHT_SCALES + INPUT_SCALES if key.endswith(s)), None)
            if suffix is None:
                continue
            weight = key[: -len(suffix)] + ".weight"
            if weight not in files or files.dtype(weight) not in FP8_DTYPES:
                what = "no tensor" if weight not in files else f"a {files.dtype(weight).name} tensor"
                raise CheckpointError(
                    f"{self._source()}: scale {key!r} belongs to {what} {weight!r}, not FP8"
                )
            hidden.add(key)
            if suffix in INPUT_SCALES:
                continue
            shape, out_channels = files.shape(key), files.shape(weight)[0]
            if math.prod(shape) not in (1, out_channels) or (
                math.prod(shape) != 1 and shape[0] != out_channels
            ):
                raise CheckpointError(
                    f"{self._source()}: scale {key!r} has shape {shape}; expected a scalar or one value per "
                    f"output channel of {weight!r} {files.shape(weight)}"
                )
            if weight in self.scales:
                raise CheckpointError(
                    f"{self._source()}: {weight!r} has two scales ({self.scales[weight]!r}, {key!r})"
                )
            self.scales[weight] = key
        self._keys = [k for k in keys if k not in hidden]
        self.metadata = getattr(files, "metadata", {})
        self.index_path = getattr(files, "index_path", None)

    def _source(self) -> str:
        return str(
            getattr(self.inner, "index_path", None) or ", ".join(str(f.path) for f in self.inner.files)
        )

    def _is_fp8(self, key: str) -> bool:
        return self.inner.dtype(key) in FP8_DTYPES

    # The CheckpointFiles API ------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def info(self, key: str):
        return self.inner.info(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.inner.shape(key)

    def dtype(self, key: str) -> np.dtype:
        return STANDS_FOR if self._is_fp8(key) else self.inner.dtype(key)

    def file_of(self, key: str):
        return self.inner.file_of(key)

    def tensor(self, key: str) -> LazyTensor:
        stored = self.inner.tensor(key)
        if not self._is_fp8(key):
            return stored
        scale_key = self.scales.get(key)
        scale = (
            np.ones((1,), np.float32)
            if scale_key is None
            else np.asarray(self.inner.read(scale_key), np.float32)
        )
        return _Dequantized(stored, scale)

    def read(self, key: str, index: Any = None) -> np.ndarray:
        tensor = self.tensor(key)
        return tensor[()] if index is None else tensor[index]

    def view(self, key: str) -> np.ndarray:
        return self.read(key) if self._is_fp8(key) else self.inner.view(key)

    @property
    def files(self):
        return self.inner.files

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> Fp8Files:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Fp8Files({self.inner!r}, {len(self.scales)} scaled weights)"


def dequantized(files: Any) -> Any:
    """``files`` as they are, or seen through :class:`Fp8Files` where they hold FP8 tensors or scales."""
    keys = list(files.keys())
    if MARKER in keys or any(files.dtype(k) in FP8_DTYPES for k in keys):
        return Fp8Files(files)
    return files
