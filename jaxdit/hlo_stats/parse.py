"""HLO module text -> computations of instructions with their array types: the parser the rest of
``jaxdit.hlo_stats`` reads a compiled program with.

After SPMD partitioning the optimized module (``compiled.as_text()``) is the program ONE device runs, so
every shape here is a per-device shape. The parser reads only what the counters need: each computation's
instructions (name, result type, opcode, operand names, the attribute text after the operands), which one
is ENTRY, and the device count from the ``HloModule`` line (``num_partitions * replica_count``). Types
follow XLA's HLO text syntax (``bf16[2,3]{1,0}``, tuples in parentheses; dynamic bounds ``<=n`` read as
``n``); sub-byte element types count packed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ArrayShape", "hlo_text"]

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
