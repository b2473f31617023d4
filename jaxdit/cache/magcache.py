"""MagCache (Ma et al., "MagCache: Fast Video Generation with Magnitude-Aware Cache", arXiv 2506.09045;
the authors' code: github.com/Zehong-Ma/MagCache ``MagCache4FLUX``, ``MagCache4Wan2.1``, ``MagCache4Wan2.2``).

The residual ``r_t`` of all the blocks (their output minus their input) changes in magnitude by a ratio
``gamma_t = mean over tokens of ||r_t|| / ||r_{t-1}||`` that is nearly the same for any prompt and seed
of a model, so it is measured once (:func:`jaxdit.cache.calibrate`, ``jaxdit generate --calibrate_magcache FILE``) and
stored. At generation, after the first ``retention`` fraction of the steps (always computed), each step
multiplies the ratios since the last full step and accumulates the error of reusing that step's
residual::

    acc_ratio *= gamma_t;   acc_err += |1 - acc_ratio|;   skipped += 1
    skip while acc_err < threshold and skipped <= max_skips (the paper's K), else compute and restart

With two guidance branches (Wan's published ratios come in conditional / unconditional pairs) each
branch keeps its accumulators and a step is computed when either asks (then both restart, as both
residuals are refreshed). The criterion reads the stored ratios only, never the step's data, so the
host computes the whole pattern before the loop and every device follows the same plan.

Ratios of another number of steps are resampled by nearest neighbour (MagCache's ``nearest_interp``).
Where jaxdit differs: MagCache4FLUX never skips its 11th of 28 steps (a hand-picked exception), and
Wan 2.2's retention restarts at the expert switch; here an expert switch is a forced full step and no
other step is special.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from jaxdit.cache.policies import _check_threshold
from jaxdit.cache.taylor import check_order

__all__ = [
    "MagCache",
    "MagCacheCalibration",
    "load_ratios",
    "magcache_pattern",
    "nearest_interp",
    "save_ratios",
    "shipped",
]

_HERE = os.path.join(os.path.dirname(__file__), "ratios")


@dataclasses.dataclass(frozen=True)
class MagCache:
    """MagCache (module docstring): ``pipe(..., cache=MagCache(threshold=0.12))``.

    ``None`` fields take the model's published (or shipped calibrated) values; ``ratios``: a ratios
    file (``jaxdit generate --calibrate_magcache``'s) or the name of a published set (``published.json``:
    ``"flux-kontext-dev"``, ...) to use instead of those; ``taylor_order``: forecast the skipped residual
    with TaylorSeer (``jaxdit.cache.taylor``) instead of reusing it.
    """

    threshold: float | None = None
    max_skips: int | None = None
    retention: float | None = None
    ratios: str | None = None
    taylor_order: int = 0

    name: ClassVar[str] = "magcache"
    title: ClassVar[str] = "MagCache"

    def __post_init__(self) -> None:
        _check_threshold(self.title, self.threshold)
        if self.max_skips is not None and (
            isinstance(self.max_skips, bool) or not isinstance(self.max_skips, int) or self.max_skips < 1
        ):
            raise ValueError(f"MagCache max_skips must be an integer >= 1, got {self.max_skips!r}")
        if self.retention is not None and not (0.0 <= float(self.retention) < 1.0):
            raise ValueError(f"MagCache retention must be in [0, 1), got {self.retention!r}")
        if self.ratios is not None and not os.path.isfile(self.ratios) and shipped(self.ratios) is None:
            raise ValueError(
                f"MagCache ratios file {self.ratios!r} does not exist (nor is it a shipped set: "
                f"{', '.join(shipped_names())})"
            )
        check_order(self.title, self.taylor_order)


@dataclasses.dataclass(frozen=True)
class MagCacheCalibration:
    """The calibration pass as a cache: every step computes every block and records ``gamma_t``."""

    name: ClassVar[str] = "magcache-calibration"
    title: ClassVar[str] = "MagCache calibration"
    threshold: ClassVar[float] = math.inf


def nearest_interp(ratios: Sequence[float], steps: int) -> np.ndarray:
    """``ratios`` resampled to ``steps`` entries by nearest neighbour (MagCache's ``nearest_interp``)."""
    src = np.asarray(ratios, np.float64)
    if steps == 1:
        return src[-1:]
    index = np.round(np.arange(steps) * ((len(src) - 1) / (steps - 1))).astype(int)
    return src[index]


def magcache_pattern(
    ratios: np.ndarray, threshold: float, max_skips: int, retention: float, forced: Sequence[int]
) -> np.ndarray:
    """bool [steps]: the steps that compute every block (module docstring). ``ratios`` [branches, steps]."""
    ratios = np.asarray(ratios, np.float64)
    branches, steps = ratios.shape
    # MagCache4FLUX: cnt >= int(retention_ratio * num_steps + 0.5) (MagCache4Wan2.1 truncates; the same
    # for its 0.2 x 50 and 0.2 x 40).
    kept = int(retention * steps + 0.5)
    forced = {s for s in forced if 0 <= s < steps}
    acc_ratio, acc_err, skipped = [1.0] * branches, [0.0] * branches, [0] * branches
    run = np.ones((steps,), bool)
    for i in range(kept, steps):
        wants = []
        for b in range(branches):
            acc_ratio[b] *= ratios[b, i]
            acc_err[b] += abs(1.0 - acc_ratio[b])
            skipped[b] += 1
            wants.append(not (acc_err[b] < threshold and skipped[b] <= max_skips))
        run[i] = any(wants) or i in forced
        if run[i]:
            acc_ratio, acc_err, skipped = [1.0] * branches, [0.0] * branches, [0] * branches
    return run


# --------------------------------------------------------------------------------------------------------
# Ratio files
# --------------------------------------------------------------------------------------------------------


def _check_entry(entry: Any, where: str) -> dict[str, Any]:
    try:
        ratios = np.asarray(entry["ratios"], np.float64)
        ok = ratios.ndim == 2 and ratios.shape[1] >= 2 and np.isfinite(ratios).all() and (ratios > 0).all()
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{where}: 'ratios' must be a list of branches, each >= 2 positive finite numbers")
    return dict(entry)


def load_ratios(path: str) -> dict[str, Any]:
    """A ratios file (:func:`save_ratios`' format) -> its entry."""
    try:
        with open(path) as f:
            entry = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read MagCache ratios {path!r}: {e}") from None
    return _check_entry(entry, path)


def write_json(path: str, entry: dict[str, Any]) -> None:
    """``entry`` as JSON at ``path``, atomically (a calibration file is whole or absent)."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump(entry, f, indent=1)
    os.replace(temporary, path)


def save_ratios(path: str, ratios: np.ndarray, **fields: Any) -> None:
    """Write ratios [branches, steps] and the defaults ``fields`` as JSON (atomically)."""
    entry = {"steps": int(np.shape(ratios)[1]), "ratios": np.round(ratios, 5).tolist(), **fields}
    _check_entry(entry, path)
    write_json(path, entry)


def shipped_names() -> list[str]:
    """The published sets' names (``published.json``): what ``MagCache(ratios=NAME)`` may name."""
    with open(os.path.join(_HERE, "published.json")) as f:
        return sorted(json.load(f))


def resolve_ratios(name_or_path: str) -> dict[str, Any]:
    """``MagCache(ratios=...)``: a ratios file, else a shipped set of that name."""
    if os.path.isfile(name_or_path):
        return load_ratios(name_or_path)
    found = shipped(name_or_path)
    if found is None:
        raise ValueError(f"MagCache ratios {name_or_path!r}: no such file or shipped set")
    return found


def shipped(key: str) -> dict[str, Any] | None:
    """The ratios jaxdit ships under ``key``: the MagCache authors' published ones (``published.json``)
    or jaxdit's own calibrations of its bundled and test models (``calibrated.json``)."""
    for name in ("published.json", "calibrated.json"):
        path = os.path.join(_HERE, name)
        if os.path.isfile(path):
            with open(path) as f:
                table = json.load(f)
            if key in table:
                return _check_entry(table[key], f"{path}[{key}]")
    return None


def config_key(family: str, config: Any) -> str:
    """The key of a model's shipped calibration: its family and a digest of its architecture."""
    import hashlib

    return f"{family}:{hashlib.sha1(repr(config).encode()).hexdigest()[:12]}"
