"""FLOPs one device performs per program run, counted from the HLO text with loop trip counts.

FLOPs
-----
``cost_analysis()`` of jax 0.10.2 counts a while-loop body ONCE, whatever its trip count (see
``tests/test_hlo_stats.py``: a ``lax.scan`` of 7 matmuls reports the FLOPs of one matmul plus the loop
counter's add and compare). Hence :func:`flops_per_device` counts FLOPs itself from the HLO text, with
the execution counts of ``walk.py``:

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

import math
import re
from dataclasses import dataclass
from typing import Any

from jaxdit.hlo_stats.parse import _module
from jaxdit.hlo_stats.walk import _expand, _Site

__all__ = ["FlopCount", "flops_per_device", "hlo_flops"]


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
