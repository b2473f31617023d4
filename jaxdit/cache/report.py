"""What a cached generation did: which steps ran every block, how much was skipped, what it cost."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["CacheReport"]

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class CacheReport:
    """The records of one cached generation (``jaxdit.cache.cached_forward``).

    ``ran`` [steps] bool: steps that ran every block (device 0's record); ``ratios`` [steps]: the
    relative L1 change each step's decision read (NaN where the host decided); ``per_device``
    [devices, steps]: every device's decisions, 1 = ran; ``devices_agree``: all rows equal.
    ``blocks_per_step``: blocks of a full step; ``always_run``: blocks that run at every step (1 for
    First-Block-Cache's first block, 0 for TeaCache; plus the blocks before the cache's start).
    """

    title: str
    threshold: float
    ran: np.ndarray
    ratios: np.ndarray
    devices: int
    devices_agree: bool
    blocks_per_step: int
    always_run: int
    bytes_per_device: int
    per_device: np.ndarray
    #: How the policy names itself (``Policy.describe``: TaylorSeer's interval, DBCache's Fn/Bn, ...).
    setting: str = ""
    #: TeaCache's calibration: the relative L1 change of the prediction at each step (``ratios`` holds
    #: its input's); None otherwise.
    output_ratios: np.ndarray | None = None

    @property
    def steps(self) -> int:
        return len(self.ran)

    @property
    def full_steps(self) -> int:
        return int(np.sum(self.ran))

    @property
    def skipped_blocks(self) -> int:
        """Block evaluations skipped over the whole generation."""
        return (self.steps - self.full_steps) * (self.blocks_per_step - self.always_run)

    @property
    def skipped_fraction(self) -> float:
        """Skipped block evaluations over those of an uncached generation."""
        return self.skipped_blocks / (self.steps * self.blocks_per_step)

    def describe(self) -> str:
        if self.devices == 1:
            agree = "one device"
        elif self.devices_agree:
            agree = f"decisions identical on all {self.devices} devices"
        else:
            agree = f"DECISIONS DIFFER between the {self.devices} devices"
        setting = self.setting or f"{self.title} (threshold {self.threshold:g})"
        return (
            f"{setting}: {self.full_steps} of {self.steps} steps ran "
            f"every block, {self.skipped_fraction:.0%} of block evaluations skipped; {agree}; cache memory "
            f"{self.bytes_per_device / MIB:.3g} MiB per device"
        )
