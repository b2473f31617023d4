"""Lazy tensors: a tensor not yet read, and lazy transpose / narrow / concatenate views of them.

A ``LazyTensor`` is indexed with unit-step slices (a "box") and reads only that box: a checkpoint entry
reads the bytes of the box from its memory map (``safetensors_file.py``), a view maps the box onto its
sources' boxes. Converter hooks (qkv split, scale/shift swap, kernel transposes; ``keymap.py``) compose
these, so converting a checkpoint's layout never materialises a whole tensor, and ``place``
(``placement.py``) hands each device only its own box.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Box", "LazyTensor", "concatenate", "narrow", "transpose"]

# A box of a tensor: one (start, stop) pair per axis, both concrete and in range.
Box = tuple[tuple[int, int], ...]


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
