"""What XLA itself reports about a compiled program: ``cost_analysis()`` FLOPs and ``memory_analysis()``.

Thin readers over ``jax.stages.Compiled``: they normalise the shapes different jax versions return (one
dict, or a list of one per module) and name the byte counts. XLA's own FLOP count is kept beside
``flops.py``'s because it differs on loops (it counts a while-loop body once); comparing the two is how
``tests/test_hlo_stats.py`` shows it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cost_analysis_flops", "memory_per_device"]


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
