"""Lazy tensors onto a device mesh: each device reads only its own box of a tensor.

``place`` builds a sharded ``jax.Array`` with ``jax.make_array_from_callback``: each device reads its box
straight from the memory map (through the lazy views of ``lazy_tensor.py``), and the dtype cast happens
per box, so a bf16 checkpoint loads as fp32 without the full tensor ever existing in fp32 on the host.
jax is imported when a tensor is placed, not with the module: reading and writing files must not pay for
(or configure) jax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from converters.checkpoint_files import CheckpointFiles
from converters.lazy_tensor import Box, _as_lazy, _box_shape, _box_slices, _resolve_index
from converters.safetensors_file import SafetensorsFile

if TYPE_CHECKING:
    import jax

__all__ = ["load", "place"]


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
