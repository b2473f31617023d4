"""Timing that means something at 90 us of work: dispatch and sync are paid once per batch, not per call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def batched_median(
    fn: Callable, args: tuple, *, warmups: int = 2, batch: int = 20, batches: int = 7
) -> float:
    """Seconds per call: ``warmups`` blocked calls, then ``batches`` batches of ``batch`` back-to-back
    calls blocked once at the end; the median of the batches' per-call times."""
    if batch < 1 or batches < 1:
        raise ValueError(f"batch and batches must be >= 1, got {batch}, {batches}")
    for _ in range(warmups):
        jax.block_until_ready(fn(*args))
    per_call = []
    for _ in range(batches):
        start = time.perf_counter()
        out = None
        for _ in range(batch):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / batch)
    return statistics.median(per_call)
