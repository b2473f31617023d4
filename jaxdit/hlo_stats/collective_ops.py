"""The collectives one device runs in a compiled program: kind, replica group, execution count, bytes.

Reads the parsed module (``parse.py``) through the execution-count walk (``walk.py``; a ``conditional``
contributes its branch with the most bytes sent per device).

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
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxdit.hlo_stats.parse import ArrayShape, _match_close, _Module, _module, _parse_shapes
from jaxdit.hlo_stats.walk import _expand, _Site

__all__ = ["COLLECTIVE_KINDS", "Collective", "collectives", "format_collectives", "summarize"]

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-to-all",
    "collective-permute",
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-broadcast",
    "send",
)


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
    # Mesh form (Shardy): mesh['a'=1,'b'=8] {'b'}: groups vary the listed axes, the others fixed; with
    # ``device_ids=([d0,d1]T(perm))`` the mesh's devices are that transposed iota, not 0..n-1 in order.
    mm = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", s)
    if mm:
        axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", mm.group(1))]
        varying = set(re.findall(r"'([^']+)'", mm.group(3)))
        ids = np.arange(math.prod(size for _, size in axes))
        if mm.group(2):
            dm = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", mm.group(2).strip())
            if not dm:
                raise ValueError(f"cannot parse device_ids in: {attrs[:200]}")
            ids = ids.reshape([int(x) for x in dm.group(1).split(",")])
            if dm.group(2):
                ids = ids.transpose([int(x) for x in dm.group(2).split(",")])
        ids = ids.reshape([size for _, size in axes])
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
