"""Declarative checkpoint key tables: each target parameter <- source key(s) through one small named hook.

A :class:`KeyTable` lists :class:`KeyRule`s. A rule names a target parameter (a dotted path in the model's
state, e.g. ``double_blocks.img_attn.q.kernel``), the source key(s) it is made from, and a :class:`Hook`
(identity, transpose, a slice of a fused tensor, a swap of halves). A rule with ``stack`` builds a stacked
parameter [layers, ...] from one source per layer; its source keys contain ``{i}``.

Everything is lazy: the hooks compose :mod:`converters.safetensors_io` views (``transpose``, ``narrow``,
``concatenate``, plus a layer ``stack`` defined here), so :func:`place_params` still reads only each
device's slice of each tensor straight from the memory-mapped files.

Strictness (diffusers' converters pop every key and load strictly; MaxText's checkpoint conversion asserts
every parameter is mapped): :func:`resolve` raises :class:`CheckpointError` naming the key and the file
for a missing source key, a key the table does not use, a tensor whose hook output does not have the
model's shape, and a tensor the table reads only part of (e.g. a fused qkv weight with one row too many).

Every hook is invertible, so :func:`invert` turns target parameters back into a source state dict: the
tests write BFL files that way, from a diffusers model's weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import ml_dtypes
import numpy as np

from converters import checks
from converters.errors import CheckpointError, CheckpointKeyError
from converters.safetensors_io import LazyTensor, concatenate, narrow, place, transpose

__all__ = [
    "Checkpoint",
    "Hook",
    "Identity",
    "KeyRule",
    "KeyTable",
    "Slice",
    "StateDict",
    "SwapHalves",
    "Transpose",
    "Without",
    "file_of",
    "invert",
    "place_params",
    "resolve",
    "stack",
    "where",
]

Box = tuple[tuple[int, int], ...]


class Checkpoint(Protocol):
    """What the key machinery reads: ``CheckpointFiles``/``SafetensorsFile`` or a :class:`StateDict`."""

    def __iter__(self) -> Iterator[str]: ...
    def __contains__(self, key: object) -> bool: ...
    def tensor(self, key: str) -> LazyTensor: ...


def file_of(ckpt: Any, key: str) -> str:
    """The file a tensor lives in (for messages)."""
    if hasattr(ckpt, "file_of"):
        try:
            return str(ckpt.file_of(key))
        except KeyError:
            pass
    return where(ckpt)


def where(ckpt: Any) -> str:
    """The checkpoint as a whole, for messages about keys it lacks."""
    if getattr(ckpt, "index_path", None) is not None:
        return str(ckpt.index_path)
    files = getattr(ckpt, "files", None)
    if files:
        return ", ".join(str(f.path) for f in files)
    return str(getattr(ckpt, "path", None) or getattr(ckpt, "name", "<checkpoint>"))


class Without:
    """``ckpt`` minus ``dropped`` keys: what the key table must account for after aliases are checked."""

    def __init__(self, ckpt: Any, dropped: set[str]) -> None:
        self._ckpt = ckpt
        self._dropped = set(dropped)
        for attr in ("index_path", "files", "path", "name"):
            if hasattr(ckpt, attr):
                setattr(self, attr, getattr(ckpt, attr))

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._ckpt if k not in self._dropped)

    def __contains__(self, key: object) -> bool:
        return key not in self._dropped and key in self._ckpt

    def tensor(self, key: str) -> LazyTensor:
        return self._ckpt.tensor(key)

    def file_of(self, key: str) -> Any:
        if hasattr(self._ckpt, "file_of"):
            return self._ckpt.file_of(key)
        return where(self._ckpt)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._ckpt.tensor(key).shape)


# --------------------------------------------------------------------------------------------------------
# In-memory state dicts behind the checkpoint interface
# --------------------------------------------------------------------------------------------------------


class _ArrayView(LazyTensor):
    def __init__(self, array: np.ndarray, key: str | None = None, origin: str | None = None) -> None:
        self._array = array
        self.key, self.origin = key, origin
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)

    def _read(self, box: Box) -> np.ndarray:
        return np.array(self._array[tuple(slice(a, b) for a, b in box)])

    def __repr__(self) -> str:
        return f"array(shape={self.shape}, dtype={self.dtype})"


class StateDict:
    """A mapping of key -> array (e.g. a torch state dict converted to numpy) as a checkpoint."""

    def __init__(self, tensors: Mapping[str, Any], name: str = "<state dict>") -> None:
        self._tensors = {k: np.asarray(v) for k, v in tensors.items()}
        self.name = name

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def tensor(self, key: str) -> LazyTensor:
        if key not in self._tensors:
            raise CheckpointKeyError(f"{self.name}: no tensor {key!r}")
        return _ArrayView(self._tensors[key], key, self.name)


# --------------------------------------------------------------------------------------------------------
# Lazy layer stacking
# --------------------------------------------------------------------------------------------------------


class _Stacked(LazyTensor):
    def __init__(self, sources: Sequence[LazyTensor]) -> None:
        if not sources:
            raise ValueError("stack needs at least one tensor")
        shapes = {s.shape for s in sources}
        if len(shapes) != 1:
            raise ValueError(f"cannot stack tensors of shapes {sorted(shapes)}")
        self._sources = tuple(sources)
        self.shape = (len(sources),) + sources[0].shape
        # A checkpoint mixing dtypes across layers is read in the widest one.
        self.dtype = np.result_type(*[s.dtype for s in sources])

    def _read(self, box: Box) -> np.ndarray:
        (lo, hi), rest = box[0], box[1:]
        out = np.empty(tuple(b - a for a, b in box), self.dtype)
        for i in range(lo, hi):  # only the layers the box covers are read
            out[i - lo] = self._sources[i]._read(rest)
        return out

    def __repr__(self) -> str:
        return f"stack([{self._sources[0]!r}, ... {len(self._sources)} layers])"


def stack(sources: Sequence[LazyTensor]) -> LazyTensor:
    """Lazy ``np.stack(sources)``: a box of the result reads only the layers and region it covers."""
    return _Stacked(sources)


# --------------------------------------------------------------------------------------------------------
# Hooks: small, named, invertible rearrangements
# --------------------------------------------------------------------------------------------------------


def _full(shape: Sequence[int]) -> Box:
    return tuple((0, d) for d in shape)


def _t(x: Any, on: bool) -> Any:
    """Swap the two axes of a 2-D weight: torch ``Linear`` stores [out, in], jaxdit kernels [in, out]."""
    if not on:
        return x
    if x.ndim != 2:
        raise ValueError(f"transpose expects a 2-D weight, got shape {tuple(x.shape)}")
    return transpose(x, (1, 0)) if isinstance(x, LazyTensor) else np.ascontiguousarray(x.T)


class Hook:
    """target = hook(sources). Subclasses say which parts of the sources they read and how to undo it."""

    name: ClassVar[str] = "hook"
    arity: ClassVar[int] = 1

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        raise NotImplementedError

    def regions(self, shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, Box]]:
        """(source index, box) of every part of the sources this hook reads."""
        return [(i, _full(s)) for i, s in enumerate(shapes)]

    def invert(self, target: np.ndarray) -> list[tuple[int, Box, np.ndarray]]:
        """(source index, box, values): where the target's values go back into the sources."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Identity(Hook):
    """The tensor as stored (biases, norm scales)."""

    name: ClassVar[str] = "identity"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        return sources[0]

    def invert(self, target: np.ndarray) -> list[tuple[int, Box, np.ndarray]]:
        return [(0, _full(target.shape), target)]


@dataclasses.dataclass(frozen=True)
class Transpose(Hook):
    """A torch ``Linear`` weight [out, in] as a kernel [in, out]."""

    name: ClassVar[str] = "transpose"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        return _t(sources[0], True)

    def invert(self, target: np.ndarray) -> list[tuple[int, Box, np.ndarray]]:
        src = _t(target, True)
        return [(0, _full(src.shape), src)]


@dataclasses.dataclass(frozen=True)
class Slice(Hook):
    """``source[start:stop]`` along ``axis`` (then transposed): one part of a fused tensor, e.g. q of qkv.

    Several rules slicing the same source must together read all of it, exactly once.
    """

    axis: int
    start: int
    stop: int
    transpose: bool = False
    label: str = "slice"

    name: ClassVar[str] = "slice"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        src = sources[0]
        if src.ndim <= self.axis or src.shape[self.axis] < self.stop:
            raise ValueError(f"{self.describe()} needs axis {self.axis} of at least {self.stop}")
        return _t(narrow(src, self.axis, self.start, self.stop), self.transpose)

    def regions(self, shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, Box]]:
        box = list(_full(shapes[0]))
        box[self.axis] = (self.start, self.stop)
        return [(0, tuple(box))]

    def invert(self, target: np.ndarray) -> list[tuple[int, Box, np.ndarray]]:
        src = _t(target, self.transpose)
        box = list(_full(src.shape))
        box[self.axis] = (self.start, self.start + src.shape[self.axis])
        return [(0, tuple(box), src)]

    def describe(self) -> str:
        return f"{self.label} [{self.start}:{self.stop}] of axis {self.axis}"


@dataclasses.dataclass(frozen=True)
class SwapHalves(Hook):
    """Swap the two halves of axis 0 (then transpose): BFL's final (shift, scale) vs diffusers' (scale,
    shift) modulation. Its own inverse."""

    transpose: bool = False
    name: ClassVar[str] = "swap_halves"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        src = sources[0]
        n = src.shape[0]
        if n % 2:
            raise ValueError(f"swap_halves needs an even leading axis, got {n}")
        h = n // 2
        return _t(concatenate([narrow(src, 0, h, n), narrow(src, 0, 0, h)], axis=0), self.transpose)

    def invert(self, target: np.ndarray) -> list[tuple[int, Box, np.ndarray]]:
        src = _t(target, self.transpose)
        n = src.shape[0]
        h = n // 2
        rest = _full(src.shape[1:])
        return [(0, ((h, n),) + rest, src[: n - h]), (0, ((0, h),) + rest, src[n - h :])]


IDENTITY = Identity()
TRANSPOSE = Transpose()


# --------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KeyRule:
    """``target`` <- ``hook(sources)``; with ``stack``, one source set per layer (``{i}`` in the keys)."""

    target: str
    sources: tuple[str, ...] | str
    hook: Hook = IDENTITY
    stack: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.sources, str):
            object.__setattr__(self, "sources", (self.sources,))
        if len(self.sources) != self.hook.arity:
            raise ValueError(f"{self.target}: hook {self.hook.name} takes {self.hook.arity} source(s)")
        templated = any("{i}" in s for s in self.sources)
        if templated != (self.stack is not None):
            raise ValueError(f"{self.target}: source keys have '{{i}}' exactly when the rule is stacked")


@dataclasses.dataclass(frozen=True)
class KeyTable:
    """A checkpoint layout: its rules and the number of layers of each stack."""

    name: str
    rules: tuple[KeyRule, ...]
    layers: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for rule in self.rules:
            if rule.target in seen:
                raise ValueError(f"{self.name}: two rules for {rule.target}")
            seen.add(rule.target)
            if rule.stack is not None and rule.stack not in self.layers:
                raise ValueError(f"{self.name}: rule {rule.target} stacks over unknown {rule.stack!r}")

    @property
    def targets(self) -> list[str]:
        return [r.target for r in self.rules]

    def source_sets(self, rule: KeyRule, prefix: str = "") -> list[tuple[str, ...]]:
        """The source keys of ``rule``: one tuple per layer (one tuple in all when not stacked)."""
        if rule.stack is None:
            return [tuple(prefix + s for s in rule.sources)]
        n = self.layers[rule.stack]
        return [tuple(prefix + s.format(i=i) for s in rule.sources) for i in range(n)]

    def source_keys(self, prefix: str = "") -> list[str]:
        """Every source key the table reads, in rule order, each once."""
        out: dict[str, None] = {}
        for rule in self.rules:
            for keys in self.source_sets(rule, prefix):
                out.update(dict.fromkeys(keys))
        return list(out)


def _check_targets(table: KeyTable, expected: Mapping[str, tuple[int, ...]]) -> None:
    """The table and the model must name the same parameters (a bug in the table, not the checkpoint)."""
    missing = [t for t in expected if t not in set(table.targets)]
    unknown = [t for t in table.targets if t not in expected]
    if missing or unknown:
        raise ValueError(
            f"key table {table.name} does not match the model: no rule for {missing[:5]}, "
            f"rules for unknown parameters {unknown[:5]}"
        )


def _list(keys: Sequence[str], n: int = 3) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _check_keys(table: KeyTable, ckpt: Checkpoint, prefix: str) -> None:
    needed = table.source_keys(prefix)
    needed_set = set(needed)
    missing = [k for k in needed if k not in ckpt]
    extra = [k for k in ckpt if k not in needed_set]
    if missing:
        hint = ""
        if extra:
            hint = f"; it holds {len(extra)} tensor(s) the table does not use: {_list(extra)} (renamed?)"
        more = f" ({len(missing)} missing in all: {_list(missing)})" if len(missing) > 1 else ""
        raise CheckpointKeyError(
            f"{where(ckpt)}: missing tensor {missing[0]!r}{more} for the {table.name} layout{hint}"
        )
    if extra:
        raise CheckpointError(
            f"{file_of(ckpt, extra[0])}: tensor {extra[0]!r} is not used by the {table.name} key table "
            f"({len(extra)} unused in all: {_list(extra)}); every tensor of a checkpoint must be consumed"
        )


def _check_dtypes(table: KeyTable, ckpt: Checkpoint, prefix: str) -> None:
    """Weights are floating point: an integer or boolean tensor would be cast silently into nonsense."""
    for key in table.source_keys(prefix):
        dtype = ckpt.tensor(key).dtype
        if not checks.is_floating(dtype):
            raise CheckpointError(
                f"{file_of(ckpt, key)}: tensor {key!r} is {dtype}, not floating point; the {table.name} "
                "layout holds only floating-point weights (a damaged or hand-edited checkpoint?)"
            )


def _disjoint(a: Box, b: Box) -> bool:
    return any(x1 <= y0 or y1 <= x0 for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def _check_coverage(table: KeyTable, ckpt: Checkpoint, read: Mapping[str, list[Box]]) -> None:
    """Every element of every source tensor is read by exactly one rule."""
    for key, boxes in read.items():
        shape = tuple(ckpt.tensor(key).shape)
        total = math.prod(shape)
        covered = sum(math.prod(b - a for a, b in box) for box in boxes)
        overlap = any(not _disjoint(x, y) for i, x in enumerate(boxes) for y in boxes[i + 1 :])
        if covered != total or overlap:
            parts = ", ".join("[" + ", ".join(f"{a}:{b}" for a, b in box) + "]" for box in boxes)
            raise CheckpointError(
                f"{file_of(ckpt, key)}: tensor {key!r} has shape {shape}, but the {table.name} key table "
                f"reads {parts} of it; the tensor is mis-shaped for this model"
            )


def resolve(
    table: KeyTable,
    ckpt: Checkpoint,
    expected: Mapping[str, tuple[int, ...]],
    *,
    prefix: str = "",
) -> dict[str, LazyTensor]:
    """Map a checkpoint onto the model's parameters, lazily: target path -> ``LazyTensor``.

    ``expected`` maps every target path to the model's shape for it (stacked parameters include the layer
    axis). ``prefix`` is prepended to every source key (e.g. ComfyUI's ``model.diffusion_model.``).
    Raises :class:`CheckpointError` (naming the key and the file) for missing, unused, mis-shaped and
    non-floating-point tensors; nothing is read but the headers.
    """
    _check_targets(table, expected)
    _check_keys(table, ckpt, prefix)
    _check_dtypes(table, ckpt, prefix)
    out: dict[str, LazyTensor] = {}
    read: dict[str, list[Box]] = {}
    for rule in table.rules:
        want = tuple(expected[rule.target])
        layer_shape = want[1:] if rule.stack is not None else want
        parts = []
        for layer, keys in enumerate(table.source_sets(rule, prefix)):
            sources = [ckpt.tensor(k) for k in keys]
            where = f"{rule.target}[{layer}]" if rule.stack is not None else rule.target
            shapes = ", ".join(f"{k!r} of shape {s.shape}" for k, s in zip(keys, sources, strict=True))
            try:
                lazy = rule.hook.apply(sources)
            except ValueError as e:
                raise CheckpointError(
                    f"{file_of(ckpt, keys[0])}: tensor {shapes} cannot give {where} "
                    f"through {rule.hook.describe()}: {e}"
                ) from None
            if tuple(lazy.shape) != layer_shape:
                raise CheckpointError(
                    f"{file_of(ckpt, keys[0])}: tensor {shapes} gives {where} the shape {lazy.shape} "
                    f"through {rule.hook.describe()}; the model expects {layer_shape}"
                )
            for idx, box in rule.hook.regions([s.shape for s in sources]):
                read.setdefault(keys[idx], []).append(box)
            parts.append(lazy)
        out[rule.target] = stack(parts) if rule.stack is not None else parts[0]
    _check_coverage(table, ckpt, read)
    return out


def place_params(
    tensors: Mapping[str, LazyTensor],
    shardings: Mapping[str, Any],
    dtype: Any = None,
) -> dict[str, Any]:
    """Place every lazy target on its sharding (each device reads only its own box), cast to ``dtype``.

    The placed parameters are then checked where they are (:func:`converters.checks.scan`): a NaN or inf
    is a :class:`CheckpointError` naming the parameter and the source tensor holding it, or saying that
    the values overflowed ``dtype``.
    """
    arrays = {path: place(t, shardings[path], dtype=dtype) for path, t in tensors.items()}
    finite, _ = checks.scan(arrays)
    if not all(finite.values()):
        bad = [tensors[p] for p, ok in finite.items() if not ok]
        origins = sorted({str(s.origin) for t in bad for s in t.stored() if getattr(s, "origin", None)})
        where = ", ".join(origins[:3]) or "checkpoint"
        checks.raise_if_nonfinite(arrays, finite, where, lambda p: _explain_nonfinite(tensors[p], dtype))
    return arrays


def _explain_nonfinite(target: LazyTensor, dtype: Any) -> str:
    """Which stored tensors behind ``target`` hold the NaN/inf, or that the cast to ``dtype`` made them."""
    culprits = []
    for source in target.stored():
        values = np.asarray(source[()])
        if not np.all(np.isfinite(values)):
            culprits.append(f"{source.key!r} holds {int(np.sum(~np.isfinite(values)))} NaN/inf value(s)")
            if len(culprits) == 3:
                break
    if culprits:
        return "source tensor " + ", ".join(culprits)
    if dtype is not None and checks.is_floating(dtype):
        top = float(ml_dtypes.finfo(np.dtype(dtype)).max)
        return f"its source tensors are finite: they hold values beyond {np.dtype(dtype)}'s range (+-{top:g})"
    return ""


def invert(table: KeyTable, params: Mapping[str, Any], *, prefix: str = "") -> dict[str, np.ndarray]:
    """Target parameters (numpy-convertible, stacked ones with the layer axis) -> a source state dict.

    Every element of every source tensor must be written exactly once; the result can be written with
    ``write_safetensors`` and read back with :func:`resolve`.
    """
    pieces: dict[str, list[tuple[Box, np.ndarray]]] = {}
    for rule in table.rules:
        value = np.asarray(params[rule.target])
        sets = table.source_sets(rule, prefix)
        layers = [value[i] for i in range(len(sets))] if rule.stack is not None else [value]
        for keys, target in zip(sets, layers, strict=True):
            for idx, box, src in rule.hook.invert(target):
                pieces.setdefault(keys[idx], []).append((box, src))
    out: dict[str, np.ndarray] = {}
    for key, parts in pieces.items():
        shape = tuple(max(box[d][1] for box, _ in parts) for d in range(len(parts[0][0])))
        arr = np.zeros(shape, parts[0][1].dtype)
        written = 0
        for box, src in parts:
            arr[tuple(slice(a, b) for a, b in box)] = src
            written += src.size
        if written != arr.size:
            raise ValueError(
                f"{table.name}: inverting writes {written} of the {arr.size} elements of {key!r}"
            )
        out[key] = arr
    return out
