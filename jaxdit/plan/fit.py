"""Does a generation fit the devices' memory? The planner's memory model, asked before anything is placed.

``jaxdit generate`` calls :func:`check_fits` once it knows the devices and the model's config, before any
weight is read or any array allocated: a request that cannot fit (100000 x 100000 pixels, a 14B model on
too few devices) is refused with what it needs, what each device has and the configurations of the same
devices that would fit, instead of failing minutes later inside an allocation.

What a device has: an accelerator's own allocator limit (``memory_stats()["bytes_limit"]``); CPU devices
(emulated ones included) share the host's available memory, so each gets its share of it. The need is
:attr:`jaxdit.plan.cost.StepCost.memory_bytes` (parameters, activations, PipeFusion's K/V): a model, not a
measurement, and it leaves out the VAE and the text encoders, so the check only refuses what is certain
to fail; it is never a promise that what passes fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxdit.mesh import ParallelConfig
from jaxdit.plan.cost import fsdp_ways, step_cost
from jaxdit.plan.latency import Hardware
from jaxdit.plan.search import plan
from jaxdit.plan.workload import Workload

__all__ = ["available_bytes", "check_fits"]

GiB = 1 << 30


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_bytes(devices: Sequence[Any]) -> int | None:
    """Memory one of ``devices`` can hold (the smallest), or None when it cannot be told."""
    limits = []
    for device in devices:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if stats and stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    if limits:
        return min(limits)
    host = _host_available_bytes()
    if host is None:
        return None
    local = max(1, sum(1 for d in devices if getattr(d, "process_index", 0) == devices[0].process_index))
    return host // local


def _weight_hint(workload: Workload, config: ParallelConfig, have: int) -> str:
    """What holding the weights otherwise would need on the same mesh: --fsdp, --quantize fp8, both."""
    options = []
    fsdp = dataclasses.replace(config, fsdp=True)
    fp8 = dataclasses.replace(workload, fp8=True)
    if not config.fsdp and fsdp_ways(fsdp) > 1:
        options.append(("--fsdp", workload, fsdp))
    if not workload.fp8:
        options.append(("--quantize fp8", fp8, config))
        if not config.fsdp and fsdp_ways(fsdp) > 1:
            options.append(("--fsdp --quantize fp8", fp8, fsdp))
    said = []
    for flags, w, c in options:
        need = step_cost(w, c).memory_bytes
        said.append(f"{flags}: {need / GiB:.1f} GiB{' (fits)' if need <= have else ''}")
    return f"; on this mesh with {', '.join(said)}" if said else ""


def _devices_hint(workload: Workload, config: ParallelConfig, count: int, have: int) -> str:
    """The fewest devices of this size (up to 64, doubling) on which a configuration of this run's
    choices (dtype, --fsdp, --quantize) fits, or nothing when none does."""
    hardware = Hardware(memory_gb=have / 1e9)
    more = count * 2
    while more <= 64:
        fitting = [
            p.config.describe()
            for p in plan(workload, more, hardware, fsdp=bool(config.fsdp)).plans
            if p.fits and p.runnable and p.exact
        ]
        if fitting:
            return f"; with more devices: {more} ({fitting[0]})"
        more *= 2
    return ""


def check_fits(workload: Workload, config: ParallelConfig, devices: Sequence[Any]) -> int:
    """Raise ValueError if the cost model's memory per device for ``workload`` on ``config`` exceeds what
    ``devices`` have, naming both and the configurations of as many devices that fit. Returns the need."""
    need = step_cost(workload, config).memory_bytes
    have = available_bytes(devices)
    if have is None or need <= have:
        return need
    fitting = [
        p.config.describe()
        for p in plan(workload, len(devices), Hardware(memory_gb=have / 1e9), fsdp=bool(config.fsdp)).plans
        if p.fits and p.runnable and p.exact
    ]
    hint = (
        f"configurations of {len(devices)} devices that fit: {'; '.join(fitting[:4])}"
        if fitting
        else "no configuration of these devices fits: use more devices, a smaller size or fewer frames"
        # Only what the request has not already chosen: bf16 halves a float32 run's bytes.
        + (", or --dtype bfloat16" if workload.dtype == "float32" else "")
    )
    hint += _weight_hint(workload, config, have)
    if not fitting:
        hint += _devices_hint(workload, config, len(devices), have)
    raise ValueError(
        f"{workload.describe()} with {config.describe()} needs about {need / GiB:.1f} GiB per device (the "
        f"planner's model: parameters, activations, K/V), and each device has {have / GiB:.1f} GiB; {hint}"
    )
