"""Walking a parsed HLO module's call graph from ENTRY: every instruction with how many times it runs.

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
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxdit.hlo_stats.parse import _Computation, _Instr, _Module

_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?\s*\}')


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
