"""What a compiled JAX program really does: its collectives, FLOPs and memory, per device.

Everything here reads a compiled program, ``compiled = jax.jit(f).lower(*args).compile()``: the
optimized, SPMD-partitioned HLO module text (``compiled.as_text()``), and ``cost_analysis()`` /
``memory_analysis()``. After SPMD partitioning the module is the program ONE device runs, so every
number below is per device. The public functions also accept the HLO text itself (a ``str``), which is
how the tests feed hand-written HLO with forms the CPU backend never emits (async collectives,
iota replica groups).

The package, by job (each module's docstring gives its conventions):

- ``parse.py``: the HLO text -> computations, instructions and array types (``ArrayShape``, ``hlo_text``).
- ``walk.py``: execution counts: the call graph from ENTRY, while loops times their known trip counts,
  the costliest branch of a conditional.
- ``collective_ops.py``: the collectives one device runs, their replica groups, bytes per device and
  bytes sent (``Collective``, ``collectives``, ``summarize``, ``format_collectives``).
- ``flops.py``: FLOPs counted from the HLO with trip counts (``FlopCount``, ``hlo_flops``,
  ``flops_per_device``), since ``cost_analysis()`` counts a loop body once.
- ``xla_reports.py``: what XLA reports itself (``cost_analysis_flops``, ``memory_per_device``).

Callers import from ``jaxdit.hlo_stats``; the names below are the public ones.
"""

from __future__ import annotations

from jaxdit.hlo_stats.collective_ops import (
    COLLECTIVE_KINDS,
    Collective,
    collectives,
    format_collectives,
    summarize,
)
from jaxdit.hlo_stats.flops import FlopCount, flops_per_device, hlo_flops
from jaxdit.hlo_stats.parse import ArrayShape, hlo_text
from jaxdit.hlo_stats.xla_reports import cost_analysis_flops, memory_per_device

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
