"""The machinery every LoRA layout shares: parse keys into modules, map modules onto jaxdit parameters
through the base checkpoint's key table, check ranks and shapes, and factor the update through the
table's hooks.

A LoRA file names modules of some base layout (BFL or diffusers for FLUX, the original or diffusers for
Wan), sometimes spelled differently (kohya writes ``double_blocks.0.img_attn.qkv`` as
``lora_unet_double_blocks_0_img_attn_qkv``). A :class:`LoraLayout` says how: key prefixes, the suffix of
each role (``lora_down``/``lora_up``/``alpha``/``diff``/``diff_b``), the base key table, and the alpha rule.
The table's rules then say which jaxdit parameters a module's weight feeds and through which hook
(transpose, a slice of a fused qkv or ``linear1``, a swap of halves); a low-rank update ``up @ down``
goes through the same hook as factors:

- ``transpose``: kernel [in, out] += down.T @ up.T;
- ``slice`` of rows (q, k, v of a fused qkv): the same rows of ``up``; of columns (the attention and MLP
  halves of a single block's ``linear2``): the same columns of ``down``;
- ``swap_halves`` (diffusers' ``norm_out`` (scale, shift) vs BFL's (shift, scale)): the halves of ``up``.

Any other hook (the Wan patch embedding's Conv3d) gets the full delta ``up @ down``, which is small there.
Full deltas (``.diff``, ``.diff_b``, PEFT's ``lora_B.bias``) go through the hook as they are.

Strictness, as for checkpoints: every key of the file is consumed or named in an error; ranks of
``lora_down`` and ``lora_up`` must agree (and match PEFT's metadata); the update's shape must be the
model's (a LoRA for another model size fails here, naming the key); every tensor must be finite.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import CheckpointError
from converters.keymap import Hook, KeyRule, KeyTable, Slice, StateDict, SwapHalves, Transpose
from converters.safetensors_io import LazyTensor

__all__ = [
    "COMFY_PREFIXES",
    "COMFY_SUFFIXES",
    "KOHYA_SUFFIXES",
    "PEFT_SUFFIXES",
    "DOWN",
    "UP",
    "ALPHA",
    "DIFF",
    "DIFF_B",
    "UP_BIAS",
    "DeltaUpdate",
    "LoraError",
    "LoraLayout",
    "LowRankUpdate",
    "Module",
    "ModuleKeys",
    "convert_modules",
    "parse_keys",
    "peft_metadata",
]

#: Roles of a file's tensors. DOWN [r, in] and UP [out, r] are the factors (torch ``Linear`` layout), ALPHA
#: a scalar (the update is scaled by alpha / rank), DIFF / DIFF_B full deltas of a weight / bias (ComfyUI),
#: UP_BIAS a bias delta scaled like the factors (PEFT's ``lora_bias``).
DOWN, UP, ALPHA, DIFF, DIFF_B, UP_BIAS = "down", "up", "alpha", "diff", "diff_b", "up_bias"

#: Suffix -> role of the common spellings: kohya's (sd-scripts, musubi-tuner), ComfyUI's (kohya's or PEFT's
#: factor names, full deltas) and PEFT's (diffusers; some files keep kohya's factor names).
KOHYA_SUFFIXES = {".lora_down.weight": DOWN, ".lora_up.weight": UP, ".alpha": ALPHA}
COMFY_SUFFIXES = {
    **KOHYA_SUFFIXES,
    ".lora_A.weight": DOWN,
    ".lora_B.weight": UP,
    ".diff": DIFF,
    ".diff_b": DIFF_B,
}
PEFT_SUFFIXES = {**KOHYA_SUFFIXES, ".lora_A.weight": DOWN, ".lora_B.weight": UP, ".lora_B.bias": UP_BIAS}
#: ComfyUI's prefix of the diffusion model's keys (also as ``model.diffusion_model.``, or none).
COMFY_PREFIXES = ("diffusion_model.", "model.diffusion_model.", "")


class LoraError(CheckpointError):
    """A LoRA file that cannot be applied to the model; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class LowRankUpdate:
    """``kernel[layer] += a @ b``: a [in, r], b [r, out] in fp32, the layout's alpha / rank folded into b."""

    target: str
    layer: int | None
    a: np.ndarray
    b: np.ndarray
    key: str  # the file key it came from (for messages)

    @property
    def rank(self) -> int:
        return self.a.shape[1]


@dataclasses.dataclass(frozen=True)
class DeltaUpdate:
    """``param[layer] += delta`` (the parameter's per-layer shape, fp32)."""

    target: str
    layer: int | None
    delta: np.ndarray
    key: str


@dataclasses.dataclass(frozen=True)
class Module:
    """Where a file's module lands: a module of the base layout. ``rows`` (start, stop, total): the module's
    update covers only these rows of the base weight (XLabs' single-block qkv LoRA is the first 3E rows of
    BFL's ``linear1``)."""

    name: str
    rows: tuple[int, int, int] | None = None


@dataclasses.dataclass(frozen=True)
class LoraLayout:
    """One way of writing a LoRA for a model family.

    ``table``: the base checkpoint key table whose module names the file uses. ``prefixes``: accepted key
    prefixes (``""`` for none). ``suffixes``: key suffix -> role. ``rename``: the file's module name ->
    :class:`Module` (None: not a module of this layout); default: the name itself, or with
    ``underscored`` the base module whose dots became underscores (kohya, musubi-tuner). ``alpha``:
    "required" (scale alpha / rank; a missing ``.alpha`` is an error), "optional" (alpha / rank, or 1
    without alpha), "none" (scale 1) or "peft" (PEFT's ``LoraConfig`` from the file's metadata, else
    ``.alpha`` keys, else 1).
    """

    family: str
    name: str
    table: KeyTable
    prefixes: tuple[str, ...]
    suffixes: Mapping[str, str]
    alpha: str = "optional"
    underscored: bool = False
    rename: Callable[[str], Module | None] | None = None

    def __post_init__(self) -> None:
        if self.alpha not in ("required", "optional", "none", "peft"):
            raise ValueError(f"alpha rule {self.alpha!r}")
        object.__setattr__(self, "_index", _TableIndex(self.table))

    @property
    def index(self) -> _TableIndex:
        return self._index  # type: ignore[attr-defined]

    def parse(self, key: str) -> tuple[str, Module] | None:
        """(role, module) of a file key, or None when the key is not of this layout or names no module."""
        for prefix in sorted(self.prefixes, key=len, reverse=True):
            if key.startswith(prefix):
                rest = key[len(prefix) :]
                break
        else:
            return None
        suffix = next((x for x in sorted(self.suffixes, key=len, reverse=True) if rest.endswith(x)), None)
        if suffix is None:
            return None
        role, raw = self.suffixes[suffix], rest[: -len(suffix)]
        if self.rename is not None:
            module = self.rename(raw)
        elif self.underscored:
            name = self.index.underscored.get(raw)
            module = Module(name) if name is not None else None
        else:
            module = Module(raw)
        if module is None or not self.index.has(module.name, role):
            return None
        return role, module


class _TableIndex:
    """A key table by source key: which (rule, layer) reads each tensor, and the module names."""

    def __init__(self, table: KeyTable) -> None:
        self.readers: dict[str, list[tuple[KeyRule, int | None]]] = {}
        for rule in table.rules:
            for layer, keys in enumerate(table.source_sets(rule)):
                self.readers.setdefault(keys[0], []).append((rule, layer if rule.stack else None))
        self.underscored: dict[str, str] = {}
        for key in self.readers:
            module = _module_of(key)
            alias = module.replace(".", "_")
            if self.underscored.get(alias, module) != module:  # a bug in the table, not the file
                raise ValueError(
                    f"{table.name}: {module!r} and {self.underscored[alias]!r} both read {alias!r}"
                )
            self.underscored[alias] = module

    def source_key(self, module: str, role: str) -> str | None:
        """The base tensor a role of a module updates (None: the module has no such tensor)."""
        if role == DIFF:
            candidates = (module + ".weight", module)  # raw parameters (Wan's modulation) have no suffix
        elif role in (DIFF_B, UP_BIAS):
            candidates = (module + ".bias",)
        else:
            candidates = (module + ".weight",)
        return next((k for k in candidates if k in self.readers), None)

    def has(self, module: str, role: str) -> bool:
        return self.source_key(module, role) is not None


def _module_of(key: str) -> str:
    for suffix in (".weight", ".bias"):
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


@dataclasses.dataclass
class ModuleKeys:
    """A base module and the file's key for each role it has."""

    module: Module
    roles: dict[str, str]


def parse_keys(layout: LoraLayout, keys: Iterable[str]) -> tuple[dict[str, ModuleKeys], list[str]]:
    """Group a file's keys by base module: ({module name: its keys}, keys the layout does not know)."""
    modules: dict[str, ModuleKeys] = {}
    unknown = []
    for key in keys:
        parsed = layout.parse(key)
        if parsed is None:
            unknown.append(key)
            continue
        role, module = parsed
        entry = modules.setdefault(module.name, ModuleKeys(module, {}))
        if role in entry.roles:
            raise LoraError(
                f"keys {entry.roles[role]!r} and {key!r} both hold the {role} of module {module.name!r} "
                f"({layout.family} {layout.name} layout)"
            )
        entry.roles[role] = key
    return modules, unknown


# --------------------------------------------------------------------------------------------------------
# PEFT's scaling (diffusers layouts)
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PeftConfig:
    """What of PEFT's ``LoraConfig`` decides the scale: ``scaling = alpha / r`` (``/ sqrt(r)`` with rsLoRA)."""

    r: int
    lora_alpha: float
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    use_rslora: bool

    def rank_and_scale(self, module: str) -> tuple[int, float]:
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)
        return int(r), float(alpha) / (math.sqrt(r) if self.use_rslora else r)


def _pattern_key(patterns: Iterable[str], module: str) -> str:
    """PEFT's ``get_pattern_key``: the first pattern matching the module name or a dotted suffix of it."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module):
            return pattern
    return module


def peft_metadata(
    metadata: Mapping[str, str], where: str, component: str = "transformer"
) -> PeftConfig | None:
    """The ``LoraConfig`` diffusers stores as JSON under ``lora_adapter_metadata`` in the header.

    A pipeline's ``save_lora_weights`` prefixes its entries with the component (``transformer.r``), a
    model's ``save_lora_adapter`` does not. None when the file has no such metadata.
    """
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise LoraError(f"{where}: header metadata 'lora_adapter_metadata' is not JSON: {e}") from None
    prefix = component + "."
    if any(k.startswith(prefix) for k in data):
        data = {k[len(prefix) :]: v for k, v in data.items() if k.startswith(prefix)}
    if data.get("use_dora"):
        raise LoraError(f"{where}: a DoRA adapter (use_dora in its metadata); only plain LoRA is fused")
    try:
        return PeftConfig(  # PEFT's LoraConfig defaults: r = lora_alpha = 8
            r=int(data.get("r", 8)),
            lora_alpha=float(data.get("lora_alpha", 8)),
            rank_pattern=dict(data.get("rank_pattern") or {}),
            alpha_pattern=dict(data.get("alpha_pattern") or {}),
            use_rslora=bool(data.get("use_rslora", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise LoraError(f"{where}: header metadata 'lora_adapter_metadata' lacks a usable {e}") from None


# --------------------------------------------------------------------------------------------------------
# Modules -> updates
# --------------------------------------------------------------------------------------------------------


class _Shape(LazyTensor):
    """A tensor of this shape, never read: asks a hook what it would make of a tensor this shape."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape = tuple(shape)
        self.dtype = np.dtype(np.float32)

    def _read(self, box: Any) -> np.ndarray:
        raise AssertionError("a shape-only tensor is never read")


def _factor(hook: Hook, down: np.ndarray, up: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(a [in, r], b [r, out]) with ``hook(up @ down) == a @ b``, or None for a hook that has no such form."""
    if isinstance(hook, Transpose):
        return down.T, up.T
    if isinstance(hook, Slice) and hook.transpose and hook.axis == 0:
        return down.T, up[hook.start : hook.stop].T
    if isinstance(hook, Slice) and hook.transpose and hook.axis == 1:
        return down[:, hook.start : hook.stop].T, up.T
    if isinstance(hook, SwapHalves) and hook.transpose:
        half = up.shape[0] // 2
        return down.T, np.concatenate([up[half:], up[:half]]).T
    return None


def _check_coverage(hooks: Sequence[Hook], shape: tuple[int, ...], what: str) -> None:
    """The rules reading a base tensor read all of an update of ``shape``, each element once."""
    boxes = [box for hook in hooks for _, box in hook.regions([shape])]
    covered = sum(math.prod(b - a for a, b in box) for box in boxes)
    overlap = any(
        all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(p, q, strict=True))
        for i, p in enumerate(boxes)
        for q in boxes[i + 1 :]
    )
    if covered != math.prod(shape) or overlap:
        raise LoraError(
            f"{what} has shape {shape}, which the model's layout does not split exactly (a LoRA for another "
            "model size?)"
        )


class _File:
    """A LoRA file's tensors as fp32 numpy arrays, each checked finite as it is read."""

    def __init__(self, tensors: Any, path: Path) -> None:
        self.tensors, self.path = tensors, path

    def read(self, key: str) -> np.ndarray:
        raw = np.asarray(self.tensors.tensor(key)[()])
        if raw.dtype.kind != "f" and raw.dtype.name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            raise LoraError(f"{self.path}: tensor {key!r} has dtype {raw.dtype}; LoRA tensors are floats")
        arr = raw.astype(np.float32)
        bad = arr.size - int(np.isfinite(arr).sum())
        if bad:
            raise LoraError(f"{self.path}: tensor {key!r} holds {bad} NaN/inf value(s) of {arr.size}")
        return arr


def convert_modules(
    layout: LoraLayout,
    modules: Mapping[str, ModuleKeys],
    file: Any,
    path: Path,
    expected: Mapping[str, tuple[int, ...]],
    peft: PeftConfig | None = None,
) -> list[LowRankUpdate | DeltaUpdate]:
    """Every module's updates of jaxdit parameters, checked against the model's shapes ``expected``."""
    reader = _File(file, path)
    out: list[LowRankUpdate | DeltaUpdate] = []
    for entry in modules.values():
        out += _module_updates(layout, entry, reader, expected, peft)
    return out


def _layer_shape(rule: KeyRule, expected: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    shape = tuple(expected[rule.target])
    return shape[1:] if rule.stack is not None else shape


def _alpha_scale(
    layout: LoraLayout,
    module: str,
    roles: Mapping[str, str],
    rank: int,
    reader: _File,
    peft: PeftConfig | None,
) -> float:
    where = f"{reader.path}: module {module!r} ({layout.family} {layout.name} layout)"
    if layout.alpha == "peft" and peft is not None:
        if ALPHA in roles:
            raise LoraError(f"{reader.path}: key {roles[ALPHA]!r} gives an alpha and so does the metadata")
        r, scale = peft.rank_and_scale(module)
        if r != rank:
            raise LoraError(
                f"{reader.path}: key {roles[UP]!r} has rank {rank}, but the file's metadata says r={r} for "
                f"{module!r}; rank mismatch"
            )
        return scale
    if ALPHA not in roles:
        if layout.alpha == "required":
            raise LoraError(
                f"{where}: no alpha; the {layout.name} layout stores one per module (expected a key like "
                f"{roles[DOWN].rsplit('.', 2)[0]}.alpha)"
            )
        return 1.0
    alpha = reader.read(roles[ALPHA])
    if alpha.size != 1:
        raise LoraError(f"{reader.path}: alpha {roles[ALPHA]!r} has shape {alpha.shape}; expected a scalar")
    return float(alpha.reshape(())) / rank


def _module_updates(
    layout: LoraLayout,
    entry: ModuleKeys,
    reader: _File,
    expected: Mapping[str, tuple[int, ...]],
    peft: PeftConfig | None,
) -> list[LowRankUpdate | DeltaUpdate]:
    index, path = layout.index, reader.path
    module, roles, rows = entry.module.name, entry.roles, entry.module.rows
    out: list[LowRankUpdate | DeltaUpdate] = []
    scale = 1.0
    if (DOWN in roles) != (UP in roles):
        have, need = (DOWN, UP) if DOWN in roles else (UP, DOWN)
        raise LoraError(f"{path}: key {roles[have]!r} has no lora_{need} partner for module {module!r}")
    if ALPHA in roles and DOWN not in roles:
        raise LoraError(
            f"{path}: key {roles[ALPHA]!r} is an alpha for module {module!r}, which has no factors"
        )
    if DOWN in roles:
        down, up = reader.read(roles[DOWN]), reader.read(roles[UP])
        if down.ndim < 2 or up.ndim < 2:
            raise LoraError(
                f"{path}: {roles[DOWN]!r} {down.shape} and {roles[UP]!r} {up.shape} are not matrices"
            )
        rank = down.shape[0]
        if up.shape[1] != rank or any(d != 1 for d in up.shape[2:]):
            raise LoraError(
                f"{path}: key {roles[DOWN]!r} has rank {rank} but {roles[UP]!r} has shape {up.shape}; "
                "rank mismatch"
            )
        scale = _alpha_scale(layout, module, roles, rank, reader, peft)
        up2 = up.reshape(up.shape[:2])
        if rows is not None:  # an update of some rows of a fused weight: the other rows get zeros
            start, stop, total = rows
            if up2.shape[0] != stop - start:
                raise LoraError(
                    f"{path}: key {roles[UP]!r} has {up2.shape[0]} rows; the model's {module!r} expects "
                    f"{stop - start}"
                )
            up2 = np.concatenate(
                [np.zeros((start, rank), np.float32), up2, np.zeros((total - stop, rank), np.float32)]
            )
        source = index.source_key(module, DOWN)
        out += _low_rank(
            layout, source, roles[UP], down, up2 * np.float32(scale), expected, path, rows is not None
        )
    for role in (DIFF, DIFF_B, UP_BIAS):
        if role in roles:
            if role == UP_BIAS and DOWN not in roles:
                raise LoraError(
                    f"{path}: key {roles[role]!r} is a LoRA bias for {module!r}, which has no factors"
                )
            delta = reader.read(roles[role]) * np.float32(scale if role == UP_BIAS else 1.0)
            out += _full(layout, index.source_key(module, role), roles[role], delta, expected, path)
    return out


def _low_rank(
    layout: LoraLayout,
    source: str,
    key: str,
    down: np.ndarray,
    up: np.ndarray,
    expected: Mapping[str, tuple[int, ...]],
    path: Path,
    skip_zero: bool,
) -> list[LowRankUpdate | DeltaUpdate]:
    readers = layout.index.readers[source]
    shape = (up.shape[0],) + down.shape[1:]
    what = f"{path}: LoRA {key!r} (update of {source!r})"
    out: list[LowRankUpdate | DeltaUpdate] = []
    for rule, layer in readers:
        want = _layer_shape(rule, expected)
        got = _hook_shape(rule, shape, what)
        if got != want:
            raise LoraError(
                f"{what}: lora_up {up.shape[:1] + (down.shape[0],)} x lora_down {down.shape} gives "
                f"{rule.target}{'' if layer is None else f'[{layer}]'} the shape {got}; the model expects "
                f"{want} (a LoRA for another model size?)"
            )
        factors = _factor(rule.hook, down, up) if down.ndim == 2 else None
        if factors is None:  # e.g. a Conv3d patch embedding: its full delta is small
            full = (up @ down.reshape(down.shape[0], -1)).reshape(shape)
            delta = np.asarray(rule.hook.apply([StateDict({"d": full}).tensor("d")]), np.float32)
            out.append(DeltaUpdate(rule.target, layer, delta, key))
            continue
        a, b = (np.ascontiguousarray(f, np.float32) for f in factors)
        if skip_zero and not b.any():
            continue  # rows this LoRA does not cover (the MLP part of linear1 for XLabs' qkv)
        out.append(LowRankUpdate(rule.target, layer, a, b, key))
    _check_coverage([rule.hook for rule, _ in readers], shape, what)
    return out


def _full(
    layout: LoraLayout,
    source: str,
    key: str,
    delta: np.ndarray,
    expected: Mapping[str, tuple[int, ...]],
    path: Path,
) -> list[DeltaUpdate]:
    readers = layout.index.readers[source]
    what = f"{path}: tensor {key!r} (full update of {source!r})"
    out = []
    for rule, layer in readers:
        want = _layer_shape(rule, expected)
        got = _hook_shape(rule, delta.shape, what)
        if got != want:
            raise LoraError(
                f"{what}: shape {delta.shape} gives {rule.target} the shape {got}; the model expects {want} "
                "(a LoRA for another model size?)"
            )
        value = np.asarray(rule.hook.apply([StateDict({"d": delta}).tensor("d")]), np.float32)
        out.append(DeltaUpdate(rule.target, layer, value, key))
    _check_coverage([rule.hook for rule, _ in readers], delta.shape, what)
    return out


def _hook_shape(rule: KeyRule, shape: tuple[int, ...], what: str) -> tuple[int, ...]:
    try:
        return tuple(rule.hook.apply([_Shape(shape)]).shape)
    except ValueError as e:
        raise LoraError(
            f"{what}: shape {shape} does not fit {rule.target} ({rule.hook.describe()}): {e}"
        ) from None
