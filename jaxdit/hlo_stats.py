"""What a compiled JAX program really does: its collectives, FLOPs and memory, per device.

Everything here reads a compiled program, ``compiled = jax.jit(f).lower(*args).compile()``: the
optimized, SPMD-partitioned HLO module text (``compiled.as_text()``), and ``cost_analysis()`` /
``memory_analysis()``. After SPMD partitioning the module is the program ONE device runs, so every
number below is per device. The public functions also accept the HLO text itself (a ``str``), which is
how the tests feed hand-written HLO with forms the CPU backend never emits (async collectives,
iota replica groups).

Execution counts
----------------
An instruction's ``count`` is how many times it runs per program run. Starting from the ENTRY
computation, the walk follows the computations that instructions call:

- ``while``: the body runs ``n`` times and the condition ``n + 1`` times, where ``n`` is the
  ``known_trip_count`` XLA writes into the op's ``backend_config`` (``lax.scan`` and static-bound
  ``fori_loop`` always get one). Nested loops multiply. A while without a known trip count is counted
  as running once, and everything inside it is marked ``count_exact=False``.
- ``fusion`` (``calls=``), ``call`` (``to_apply=``) and ``async-start`` (``calls=``; the matching
  ``async-update``/``async-done`` are not followed, so an async-wrapped op is counted once): the callee
  runs as often as the caller.
- ``conditional``: only ONE branch runs per execution and which one is data dependent, so the walk takes
  the branch that costs most -- for collectives the branch with the most bytes sent per device
  (ties: most operand bytes, then most collectives, then the lowest branch index); for FLOPs the branch
  with the most FLOPs. Totals over a conditional are therefore an upper bound for one run.
- Reducer computations (``to_apply`` of reduce, all-reduce, sort, ...) are scalar lambdas and are not
  walked.

A computation called from several sites is visited once per site, so its instructions appear once per
call site with that site's multiplier.

Collective kinds and bytes
--------------------------
Kinds: ``all-to-all``, ``collective-permute``, ``all-reduce``, ``all-gather``, ``reduce-scatter``,
``collective-broadcast`` and ``send`` (the sending side of a point-to-point pair; ``recv`` is its
other end and is not counted). An async pair ``X-start``/``X-done`` is ONE collective of kind ``X``
(found at the ``-start``; its result shapes are taken from the ``-done``).

``Collective.bytes_per_device`` is the size of the operand buffer(s) the instruction takes on one
device, summed over all operands of a tuple-shaped (combined) collective:

- all-to-all: the whole local buffer, split in P chunks, of which P-1 leave the device (the chunk for
  the device itself stays). On CPU, XLA lowers ``lax.all_to_all`` to a tuple all-to-all of P operands,
  one per destination; their sum is that same whole buffer.
- collective-permute / send / collective-broadcast: the operand buffer.
- all-reduce: the operand buffer (equal to the result).
- all-gather: the operand, i.e. this device's shard (the result is P times larger).
- reduce-scatter: the operand, i.e. the full unreduced buffer (the result is 1/P of it).

``Collective.bytes_sent_per_device`` is what leaves one device under the usual bandwidth-optimal
(ring / pairwise) algorithms, with P the size of the instruction's replica group:

- all-to-all: ``(P-1)/P * bytes_per_device``.
- all-gather: ``(P-1) * bytes_per_device``, which is ``(P-1)/P`` of the gathered result.
- reduce-scatter: ``(P-1)/P * bytes_per_device``.
- all-reduce: ``2(P-1)/P * bytes_per_device`` (ring: reduce-scatter then all-gather).
- collective-permute: ``bytes_per_device`` if some pair moves data between two different devices
  (each device is the source of at most one pair, so this is the busiest device), else 0.
- send / collective-broadcast: ``bytes_per_device``.

The bytes are those of the compiled program, in the dtype it really moves. The CPU backend (jax 0.10.2)
carries every bf16 collective in f32 -- it converts to f32 before the collective and back after it -- so
on CPU a bf16 program's collective bytes are twice what a GPU moves; compare a cost model with a CPU
compile in f32 (see ``tests/test_hlo_stats.py::test_cpu_moves_bf16_collectives_as_f32``).

With P = 1 every factor is 0. For a collective-permute the "group size" is the size of the largest
connected set of devices its source/target pairs link (a ring ``ppermute`` over a mesh axis of size n
gives n), for ``send`` it is 2. Per-run totals are ``count * bytes_*``.

FLOPs
-----
``cost_analysis()`` of jax 0.10.2 counts a while-loop body ONCE, whatever its trip count (see
``tests/test_hlo_stats.py``: a ``lax.scan`` of 7 matmuls reports the FLOPs of one matmul plus the loop
counter's add and compare). Hence :func:`flops_per_device` counts FLOPs itself from the HLO text, with
the execution counts above:

- ``dot``: ``2 * prod(result dims) * prod(lhs contracting dims)`` (batch dims are in the result).
- ``convolution``: ``2 * prod(result dims) * prod(kernel dims except the output-feature dim)``, i.e.
  every output element sums over its whole window and its group's input features; windows that overlap
  padding are counted in full (XLA's own cost analysis skips the padded taps) and ``batch_group_count``
  is not modelled.
- elementwise (reported separately, not in :func:`flops_per_device`'s default): one FLOP per result
  element of non-transcendental arithmetic/logic/convert/compare/select ops, ``prod(input dims)`` per
  ``reduce``/``reduce-window`` input, the operand elements of all-reduce/reduce-scatter; transcendental
  ops (exp, log, tanh, ...) are counted in ``transcendentals``. This follows XLA's HloCostAnalysis
  roughly, not exactly.

On a loop-free program made of dots, the dot count equals ``cost_analysis()['flops']`` exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ArrayShape",
    "Collective",
    "FlopCount",
    "COLLECTIVE_KINDS",
    "collectives",
    "summarize",
    "flops_per_device",
    "hlo_flops",
    "cost_analysis_flops",
    "memory_per_device",
    "hlo_text",
    "format_collectives",
]

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-to-all",
    "collective-permute",
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-broadcast",
    "send",
)

# Bits per element of each HLO primitive type.
_DTYPE_BITS: dict[str, int] = {
    "pred": 8,
    "s1": 1,
    "u1": 1,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f4e2m1fn": 4,
    "f8e3m4": 8,
    "f8e4m3": 8,
    "f8e4m3fn": 8,
    "f8e4m3fnuz": 8,
    "f8e4m3b11fnuz": 8,
    "f8e5m2": 8,
    "f8e5m2fnuz": 8,
    "f8e8m0fnu": 8,
    "bf16": 16,
    "f16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}


@dataclass(frozen=True)
class ArrayShape:
    """One array in an HLO type: element type (HLO spelling, e.g. ``bf16``) and dimensions."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        """Bytes of the array, sub-byte types packed."""
        bits = _DTYPE_BITS.get(self.dtype)
        if bits is None:
            raise ValueError(f"unknown HLO element type {self.dtype!r}")
        return (self.size * bits + 7) // 8

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled program, as seen by one device.

    ``bytes_per_device`` and ``bytes_sent_per_device`` are per execution; see the module docstring
    for their exact conventions. ``count`` is the number of executions per program run (product of
    the known trip counts of the enclosing while loops, listed outer to inner in ``trip_counts``).
    """

    kind: str
    name: str
    opcode: str
    computation: str
    operand_shapes: tuple[ArrayShape, ...]
    result_shapes: tuple[ArrayShape, ...]
    group_size: int
    count: int
    trip_counts: tuple[int, ...] = ()
    count_exact: bool = True
    replica_groups: tuple[tuple[int, ...], ...] | None = None
    source_target_pairs: tuple[tuple[int, int], ...] | None = None
    op_name: str = ""

    @property
    def bytes_per_device(self) -> int:
        """Bytes of the operand buffer(s) on one device, per execution."""
        return sum(s.nbytes for s in self.operand_shapes)

    @property
    def bytes_sent_per_device(self) -> float:
        """Bytes leaving one device per execution, under ring/pairwise algorithms."""
        b = self.bytes_per_device
        p = self.group_size
        if self.kind == "collective-permute":
            moves = any(s != t for s, t in self.source_target_pairs or ())
            return float(b) if moves else 0.0
        if self.kind in ("send", "collective-broadcast"):
            return float(b) if p > 1 else 0.0
        if p <= 1:
            return 0.0
        if self.kind in ("all-to-all", "reduce-scatter"):
            return b * (p - 1) / p
        if self.kind == "all-gather":
            return float(b * (p - 1))
        if self.kind == "all-reduce":
            return 2 * b * (p - 1) / p
        raise AssertionError(self.kind)

    @property
    def total_bytes_per_device(self) -> int:
        """``count * bytes_per_device``: operand bytes over one program run."""
        return self.count * self.bytes_per_device

    @property
    def total_bytes_sent_per_device(self) -> float:
        """``count * bytes_sent_per_device``: bytes leaving one device over one program run."""
        return self.count * self.bytes_sent_per_device


@dataclass(frozen=True)
class FlopCount:
    """Trip-count-aware FLOPs of one device's program, by kind (see the module docstring)."""

    dot: int = 0
    convolution: int = 0
    elementwise: int = 0
    transcendentals: int = 0
    count_exact: bool = True

    @property
    def matmul(self) -> int:
        """``dot + convolution``: the FLOPs MFU is measured against."""
        return self.dot + self.convolution

    @property
    def total(self) -> int:
        """``dot + convolution + elementwise`` (transcendentals excluded, as in XLA)."""
        return self.dot + self.convolution + self.elementwise


# --------------------------------------------------------------------------------------------------
# HLO text parsing


@dataclass
class _Instr:
    name: str
    type_str: str
    opcode: str
    operands: list[str]
    attrs: str
    is_root: bool

    @property
    def shapes(self) -> list[ArrayShape]:
        return _parse_shapes(self.type_str)


@dataclass
class _Computation:
    name: str
    is_entry: bool
    instrs: list[_Instr] = field(default_factory=list)
    by_name: dict[str, _Instr] = field(default_factory=dict)
    users: dict[str, list[_Instr]] = field(default_factory=dict)


@dataclass
class _Module:
    computations: dict[str, _Computation]
    entry: str
    num_devices: int


_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,<=\s]*)\]")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"\s*([A-Za-z][\w\-]*)\(")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?\s*\}')


def _parse_shapes(type_str: str) -> list[ArrayShape]:
    """All arrays in an HLO type, tuples flattened in order."""
    out = []
    for m in _SHAPE_RE.finditer(type_str):
        dtype, dims = m.group(1), m.group(2).strip()
        if dtype not in _DTYPE_BITS:
            continue
        out.append(
            ArrayShape(dtype, tuple(int(d.replace("<=", "").strip()) for d in dims.split(",") if d.strip()))
        )
    return out


def _match_close(s: str, start: int) -> int:
    """Index of the bracket closing the one at ``s[start]`` (round/curly/square brackets, quotes)."""
    depth = 0
    in_str = False
    i = start
    while i < len(s):
        c = s[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unbalanced brackets in HLO line: {s[:200]}")


def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts]


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    rest = rest.lstrip()
    if rest.startswith("("):
        end = _match_close(rest, 0)
        type_str, rest = rest[: end + 1], rest[end + 1 :]
    else:
        sp = rest.find(" ")
        if sp < 0:
            return None
        type_str, rest = rest[:sp], rest[sp:]
    om = _OPCODE_RE.match(rest)
    if not om:
        return None
    opcode = om.group(1)
    open_idx = om.end() - 1
    close_idx = _match_close(rest, open_idx)
    operands = []
    # Long operand lists carry position comments: "%a, ..., /*index=5*/%f".
    for tok in _split_top(_COMMENT_RE.sub("", rest[open_idx + 1 : close_idx])):
        # Operands print as "%name" or, in some dumps, "f32[2]{0} %name".
        operands.append(tok.split()[-1].lstrip("%") if tok else tok)
    attrs = rest[close_idx + 1 :]
    return _Instr(name, type_str, opcode, operands, attrs, is_root)


def _parse_module(text: str) -> _Module:
    comps: dict[str, _Computation] = {}
    entry = None
    cur: _Computation | None = None
    num_partitions = 1
    replica_count = 1
    for line in text.splitlines():
        if line.startswith("HloModule"):
            if m := re.search(r"num_partitions=(\d+)", line):
                num_partitions = int(m.group(1))
            if m := re.search(r"replica_count=(\d+)", line):
                replica_count = int(m.group(1))
            continue
        if cur is None:
            hm = _HEADER_RE.match(line)
            if hm:
                cur = _Computation(hm.group(2), bool(hm.group(1)))
                comps[cur.name] = cur
                if cur.is_entry:
                    entry = cur.name
            continue
        if line.strip() == "}":
            cur = None
            continue
        ins = _parse_instr(line)
        if ins is None:
            continue
        cur.instrs.append(ins)
        cur.by_name[ins.name] = ins
        for op in ins.operands:
            cur.users.setdefault(op, []).append(ins)
    if entry is None:
        raise ValueError("no ENTRY computation found in the HLO text")
    return _Module(comps, entry, num_partitions * replica_count)


def hlo_text(compiled: Any) -> str:
    """The optimized HLO module text of a compiled program (or the text itself if given a str)."""
    if isinstance(compiled, str):
        return compiled
    text = compiled.as_text()
    if not isinstance(text, str):  # some versions return one text per module
        text = "\n".join(text)
    return text


def _module(compiled: Any) -> _Module:
    return _parse_module(hlo_text(compiled))


# --------------------------------------------------------------------------------------------------
# Walking the call graph with execution counts


@dataclass(frozen=True)
class _Site:
    comp: _Computation
    instr: _Instr
    count: int
    trips: tuple[int, ...]
    exact: bool


def _callee(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([^\s,{{}}]+)", attrs)
    return m.group(1) if m else None


def _callee_list(attrs: str, key: str) -> list[str]:
    m = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
    if m:
        return [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
    one = _callee(attrs, key)
    return [one] if one else []


def _expand(
    mod: _Module,
    comp_name: str,
    count: int,
    trips: tuple[int, ...],
    exact: bool,
    branch_cost: Callable[[list[_Site]], Any],
    depth: int = 0,
) -> list[_Site]:
    if depth > 200:
        raise RecursionError("HLO call graph deeper than 200 levels")
    comp = mod.computations[comp_name]
    sites: list[_Site] = []
    for ins in comp.instrs:
        sites.append(_Site(comp, ins, count, trips, exact))
        op = ins.opcode
        if op == "while":
            m = _TRIP_RE.search(ins.attrs)
            n = int(m.group(1)) if m else 1
            ok = exact and m is not None
            body, cond = _callee(ins.attrs, "body"), _callee(ins.attrs, "condition")
            if body:
                sites += _expand(mod, body, count * n, (*trips, n), ok, branch_cost, depth + 1)
            if cond:
                sites += _expand(mod, cond, count * (n + 1), trips, ok, branch_cost, depth + 1)
        elif op == "conditional":
            branches = _callee_list(ins.attrs, "branch_computations")
            if not branches:
                branches = [
                    b
                    for b in (_callee(ins.attrs, "true_computation"), _callee(ins.attrs, "false_computation"))
                    if b
                ]
            expanded = [_expand(mod, b, count, trips, exact, branch_cost, depth + 1) for b in branches]
            if expanded:
                # max() keeps the first of equal keys; negate index to prefer the lowest branch.
                best = max(range(len(expanded)), key=lambda i: (branch_cost(expanded[i]), -i))
                sites += expanded[best]
        elif op in ("fusion", "async-start"):
            for c in _callee_list(ins.attrs, "calls"):
                sites += _expand(mod, c, count, trips, exact, branch_cost, depth + 1)
        elif op == "call":
            c = _callee(ins.attrs, "to_apply")
            if c:
                sites += _expand(mod, c, count, trips, exact, branch_cost, depth + 1)
    return sites


# --------------------------------------------------------------------------------------------------
# Collectives


def _kind_of(opcode: str) -> str | None:
    if opcode in COLLECTIVE_KINDS:
        return opcode
    if opcode.endswith("-start") and opcode[: -len("-start")] in COLLECTIVE_KINDS:
        return opcode[: -len("-start")]
    return None


def _parse_groups(attrs: str, num_devices: int) -> tuple[tuple[int, ...], ...] | None:
    m = re.search(r"replica_groups=", attrs)
    if not m:
        return None
    s = attrs[m.end() :]
    if s.startswith("{"):
        body = s[: _match_close(s, 0) + 1]
        listed = re.findall(r"\{([0-9,\s]*)\}", body[1:-1])
        groups = tuple(tuple(int(x) for x in g.split(",") if x.strip()) for g in listed)
        groups = tuple(g for g in groups if g)
        return groups or (tuple(range(num_devices)),)
    # Mesh form (Shardy): mesh['a'=1,'b'=8] {'b'}: groups vary the listed axes, the others fixed.
    mm = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", s)
    if mm:
        axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", mm.group(1))]
        varying = set(re.findall(r"'([^']+)'", mm.group(2)))
        ids = np.arange(math.prod(size for _, size in axes)).reshape([size for _, size in axes])
        order = [i for i, (n, _) in enumerate(axes) if n not in varying] + [
            i for i, (n, _) in enumerate(axes) if n in varying
        ]
        group_size = math.prod(size for n, size in axes if n in varying)
        rows = ids.transpose(order).reshape(-1, group_size)
        return tuple(tuple(int(x) for x in row) for row in rows)
    # Iota form: [G,S]<=[d0,d1,...] optionally followed by T(perm).
    im = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", s)
    if not im:
        raise ValueError(f"cannot parse replica_groups in: {attrs[:200]}")
    out_dims = [int(x) for x in im.group(1).split(",")]
    src_dims = [int(x) for x in im.group(2).split(",")]
    ids = np.arange(math.prod(src_dims)).reshape(src_dims)
    if im.group(3):
        ids = ids.transpose([int(x) for x in im.group(3).split(",")])
    ids = ids.reshape(out_dims[0], -1) if len(out_dims) > 1 else ids.reshape(1, -1)
    return tuple(tuple(int(x) for x in row) for row in ids)


def _parse_pairs(attrs: str) -> tuple[tuple[int, int], ...] | None:
    m = re.search(r"source_target_pairs=\{", attrs)
    if not m:
        return None
    s = attrs[m.end() - 1 :]
    body = s[: _match_close(s, 0) + 1]
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", body))


def _largest_component(pairs: Iterable[tuple[int, int]]) -> int:
    parent: dict[int, int] = {}

    def find(a: int) -> int:
        parent.setdefault(a, a)
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a, b in pairs:
        parent[find(a)] = find(b)
    sizes: dict[int, int] = {}
    for a in list(parent):
        r = find(a)
        sizes[r] = sizes.get(r, 0) + 1
    return max(sizes.values(), default=1)


def _op_name(attrs: str) -> str:
    m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', attrs)
    return m.group(1) if m else ""


def _make_collective(mod: _Module, site: _Site) -> Collective | None:
    ins, comp = site.instr, site.comp
    kind = _kind_of(ins.opcode)
    if kind is None:
        return None
    operand_shapes: list[ArrayShape] = []
    for op in ins.operands:
        src = comp.by_name.get(op)
        if src is None:
            raise ValueError(f"operand {op!r} of {ins.name} not defined in computation {comp.name}")
        operand_shapes += src.shapes
    if kind == "send":
        operand_shapes = operand_shapes[:1]  # (data, token)
    operand_shapes = [s for s in operand_shapes if s.dtype != "token"]
    result_type = ins.type_str
    if ins.opcode.endswith("-start"):
        done_op = ins.opcode[: -len("-start")] + "-done"
        dones = [u for u in comp.users.get(ins.name, []) if u.opcode == done_op]
        if dones:
            result_type = dones[0].type_str
    result_shapes = [s for s in _parse_shapes(result_type) if s.dtype != "token"]
    if kind == "send":
        result_shapes = []
    groups = _parse_groups(ins.attrs, mod.num_devices)
    pairs = _parse_pairs(ins.attrs)
    if kind == "collective-permute":
        group_size = _largest_component(pairs or ())
    elif kind == "send":
        group_size = 2
    elif groups is not None:
        group_size = max(len(g) for g in groups)
    else:
        group_size = mod.num_devices
    return Collective(
        kind=kind,
        name=ins.name,
        opcode=ins.opcode,
        computation=comp.name,
        operand_shapes=tuple(operand_shapes),
        result_shapes=tuple(result_shapes),
        group_size=group_size,
        count=site.count,
        trip_counts=site.trips,
        count_exact=site.exact,
        replica_groups=groups,
        source_target_pairs=pairs,
        op_name=_op_name(ins.attrs),
    )


def collectives(compiled: Any) -> list[Collective]:
    """Every collective one device executes, in program order, with execution counts and bytes.

    ``compiled`` is a ``jax.stages.Compiled`` (or its HLO text). Conventions: module docstring.
    """
    mod = _module(compiled)
    # One parse per instruction; the execution count differs per call site.
    base: dict[tuple[str, str], Collective | None] = {}

    def get(site: _Site) -> Collective | None:
        key = (site.comp.name, site.instr.name)
        if key not in base:
            base[key] = _make_collective(mod, _Site(site.comp, site.instr, 1, (), True))
        c = base[key]
        if c is None:
            return None
        return dataclasses.replace(c, count=site.count, trip_counts=site.trips, count_exact=site.exact)

    def cost(sites: list[_Site]) -> tuple[float, int, int]:
        cs = [c for c in map(get, sites) if c is not None]
        return (
            sum(c.total_bytes_sent_per_device for c in cs),
            sum(c.total_bytes_per_device for c in cs),
            sum(c.count for c in cs),
        )

    sites = _expand(mod, mod.entry, 1, (), True, cost)
    return [c for c in map(get, sites) if c is not None]


def summarize(compiled: Any) -> dict[str, dict[str, float]]:
    """Per-device totals over one program run, by collective kind, plus ``"total"``.

    Every kind in :data:`COLLECTIVE_KINDS` is present (zeros when absent), each a dict with
    ``instructions`` (distinct HLO instructions), ``count`` (executions), ``bytes``
    (``sum(count * bytes_per_device)``) and ``bytes_sent`` (``sum(count * bytes_sent_per_device)``).
    """
    out: dict[str, dict[str, float]] = {
        k: {"instructions": 0, "count": 0, "bytes": 0, "bytes_sent": 0.0}
        for k in (*COLLECTIVE_KINDS, "total")
    }
    for c in collectives(compiled):
        for k in (c.kind, "total"):
            out[k]["instructions"] += 1
            out[k]["count"] += c.count
            out[k]["bytes"] += c.total_bytes_per_device
            out[k]["bytes_sent"] += c.total_bytes_sent_per_device
    return out


# --------------------------------------------------------------------------------------------------
# FLOPs

_TRANSCENDENTAL = frozenset(
    {
        "exponential",
        "exponential-minus-one",
        "log",
        "log-plus-one",
        "tanh",
        "logistic",
        "sqrt",
        "rsqrt",
        "cbrt",
        "sine",
        "cosine",
        "tan",
        "atan2",
        "erf",
        "power",
    }
)
_ELEMENTWISE = frozenset(
    {
        "add",
        "subtract",
        "multiply",
        "divide",
        "remainder",
        "maximum",
        "minimum",
        "negate",
        "abs",
        "sign",
        "floor",
        "ceil",
        "round-nearest-afz",
        "round-nearest-even",
        "compare",
        "select",
        "clamp",
        "convert",
        "and",
        "or",
        "xor",
        "not",
        "shift-left",
        "shift-right-logical",
        "shift-right-arithmetic",
        "is-finite",
        "real",
        "imag",
        "complex",
        "popcnt",
        "count-leading-zeros",
    }
)


def _dims_attr(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([0-9,\s]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x.strip()] if m else []


def _site_flops(site: _Site) -> tuple[int, int, int, int]:
    """(dot, convolution, elementwise, transcendental) FLOPs of one execution of the instruction."""
    ins, comp = site.instr, site.comp
    op = ins.opcode
    if op == "dot":
        out = ins.shapes[0]
        lhs = comp.by_name[ins.operands[0]].shapes[0]
        k = math.prod(lhs.dims[d] for d in _dims_attr(ins.attrs, "lhs_contracting_dims"))
        return 2 * out.size * k, 0, 0, 0
    if op == "convolution":
        out = ins.shapes[0]
        rhs = comp.by_name[ins.operands[1]].shapes[0]
        m = re.search(r"dim_labels=[^_\s,]+_([^-\s,]+)->", ins.attrs)
        labels = m.group(1) if m else ""
        o = labels.find("o")
        k = math.prod(d for i, d in enumerate(rhs.dims) if i != o)
        return 0, 2 * out.size * k, 0, 0
    if op in _TRANSCENDENTAL:
        return 0, 0, 0, sum(s.size for s in ins.shapes)
    if op in _ELEMENTWISE:
        return 0, 0, sum(s.size for s in ins.shapes), 0
    if op in ("reduce", "reduce-window", "all-reduce", "all-reduce-start", "reduce-scatter"):
        n = len(ins.operands) // 2 if op in ("reduce", "reduce-window") else len(ins.operands)
        return 0, 0, sum(s.size for o in ins.operands[: max(n, 1)] for s in comp.by_name[o].shapes), 0
    return 0, 0, 0, 0


def hlo_flops(compiled: Any) -> FlopCount:
    """Trip-count-aware FLOPs per device, counted from the HLO text, by kind (module docstring)."""
    mod = _module(compiled)

    def cost(sites: list[_Site]) -> tuple[int, int]:
        per = [(_site_flops(s), s.count) for s in sites]
        return (
            sum((f[0] + f[1]) * n for f, n in per),
            sum((f[0] + f[1] + f[2]) * n for f, n in per),
        )

    sites = _expand(mod, mod.entry, 1, (), True, cost)
    tot = [0, 0, 0, 0]
    exact = True
    for s in sites:
        f = _site_flops(s)
        if any(f):
            exact = exact and s.exact
        for i in range(4):
            tot[i] += f[i] * s.count
    return FlopCount(*tot, count_exact=exact)


def flops_per_device(compiled: Any, *, include_elementwise: bool = False) -> int:
    """FLOPs one device performs per program run, while-loop bodies times their trip counts.

    Counted from the HLO text (``cost_analysis()`` counts a loop body once in jax 0.10.2): dots and
    convolutions by default; with ``include_elementwise`` also one FLOP per element of elementwise and
    reduction ops. Conventions: module docstring.
    """
    f = hlo_flops(compiled)
    return f.total if include_elementwise else f.matmul


def _cost_dict(compiled: Any) -> dict[str, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):  # older jax: one dict per module
        ca = ca[0] if ca else {}
    return dict(ca or {})


def cost_analysis_flops(compiled: Any) -> float:
    """``compiled.cost_analysis()['flops']`` as XLA reports it: loop bodies counted ONCE (jax 0.10.2)."""
    return float(_cost_dict(compiled).get("flops", 0.0))


def memory_per_device(compiled: Any) -> dict[str, int]:
    """``compiled.memory_analysis()`` as a dict of byte counts for one device.

    Keys: ``argument``, ``output``, ``alias`` (output bytes that reuse argument buffers), ``temp``,
    ``generated_code``, ``peak`` (when the backend reports it, else 0), the ``host_*`` counterparts, and
    ``total = argument + output - alias + temp + generated_code``. On the CPU backend bf16 programs keep
    f32 upcast copies in ``temp`` (XLA's CPU backend computes bf16 dots in f32; ``tests/test_flux_fullsize.py``
    prints both).
    """
    m = compiled.memory_analysis()
    if m is None:
        raise ValueError("this backend provides no memory_analysis()")
    names = {
        "argument": "argument_size_in_bytes",
        "output": "output_size_in_bytes",
        "alias": "alias_size_in_bytes",
        "temp": "temp_size_in_bytes",
        "generated_code": "generated_code_size_in_bytes",
        "peak": "peak_memory_in_bytes",
        "host_argument": "host_argument_size_in_bytes",
        "host_output": "host_output_size_in_bytes",
        "host_alias": "host_alias_size_in_bytes",
        "host_temp": "host_temp_size_in_bytes",
        "host_generated_code": "host_generated_code_size_in_bytes",
    }
    out = {k: int(getattr(m, a, 0) or 0) for k, a in names.items()}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["generated_code"]
    return out


def format_collectives(compiled: Any) -> str:
    """One JSON line per collective: kind, count, bytes, shapes, op_name (for eyeballing a program)."""
    return "\n".join(
        json.dumps(
            {
                "kind": c.kind,
                "count": c.count,
                "P": c.group_size,
                "bytes": c.bytes_per_device,
                "sent": c.bytes_sent_per_device,
                "operands": [str(s) for s in c.operand_shapes],
                "op_name": c.op_name,
            }
        )
        for c in collectives(compiled)
    )
