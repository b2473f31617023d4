"""Calibrations of MagCache and TeaCache from one generation that computes every block.

MagCache's: one generation that computes every block and records, at each step, the
magnitude ratio ``gamma_t = mean over tokens of ||r_t|| / ||r_{t-1}||`` of the residual of all blocks
(MagCache, arXiv 2506.09045, section 3; the authors' ``magcache_calibration`` flag). The ratios are
nearly the same for any prompt and seed of a model, so one run records them for good:

    jaxdit generate --model tiny-digits --calibrate_magcache ratios.json     # then --magcache_ratios
    calibrate(pipe, "0123456789", num_inference_steps=20, ...)               # the same from Python

``ratios.json`` (:func:`save_calibration_file`) is what ``MagCache(ratios=...)`` and ``--magcache_ratios``
read; jaxdit's own calibrations of its bundled model live in ``jaxdit/cache/ratios/calibrated.json``
(``scripts/calibrate_magcache.py`` writes them). With guidance the ratio is measured over both branches
together (one decision per step covers both, as everywhere in jaxdit's caches).

TeaCache's (Liu et al., arXiv 2411.19108: a polynomial rescales the input's change into the
output's): the same kind of run records, at every step t >= 1, the relative L1 change of the model's
TeaCache input ``x`` (``mean|x_t - x_{t-1}| / mean|x_{t-1}|``: FLUX's and Z-Image's first modulated
block input) and of the model's prediction ``y``, and fits ``numpy.polyfit(x_changes, y_changes, 4)``
(highest power first, what ``TeaCache(coefficients=...)`` takes), as the TeaCache authors fit theirs:

    jaxdit generate ... --calibrate_teacache poly.json         # then --cache teacache --teacache_coefficients poly.json
    calibrate_teacache(pipe, "a prompt", num_inference_steps=8, ...)

The file (:func:`save_teacache_file`) keeps the recorded changes beside the polynomial and a default
threshold (TeaCache4FLUX's 0.4). One run of S steps gives S - 1 points: 6 steps at least for a 4th-order fit.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jaxdit.cache.magcache import MagCacheCalibration, save_ratios, write_json
from jaxdit.cache.policies import TEACACHE_THRESHOLD, TeaCacheCalibration, load_teacache_file

__all__ = [
    "CALIBRATED_FILE",
    "TEACACHE_ORDER",
    "calibrate",
    "calibrate_teacache",
    "fit_teacache",
    "load_teacache_file",  # re-exported from jaxdit.cache.policies, beside the file's writer
    "ratios_of",
    "save_calibration_file",
    "save_teacache_file",
    "ship",
]

#: jaxdit's calibrations of its bundled and test models, keyed by ``magcache.config_key``.
CALIBRATED_FILE = os.path.join(os.path.dirname(__file__), "ratios", "calibrated.json")
#: The defaults recorded with a calibration (the authors' Wan 2.1 settings): threshold, K, retention.
DEFAULTS = {"threshold": 0.12, "max_skips": 2, "retention": 0.2}


def ratios_of(report: Any) -> np.ndarray:
    """[1, steps] ratios from a calibration run's report; step 0 has no previous residual: 1.0."""
    ratios = np.asarray(report.ratios, np.float64).copy()
    ratios[0] = 1.0
    if not np.isfinite(ratios).all() or (ratios <= 0).any():
        raise ValueError(
            f"the calibration measured unusable magnitude ratios: {np.round(ratios, 4).tolist()}"
        )
    return ratios[None]


def calibrate(pipe: Any, prompt: Any, **call: Any) -> np.ndarray:
    """Run ``pipe(prompt, **call)`` computing every block; -> its ratios [1, steps]."""
    out = pipe(prompt, cache=MagCacheCalibration(), **call)
    return ratios_of(out.cache)


def save_calibration_file(path: str, ratios: np.ndarray, source: str, **defaults: Any) -> None:
    """A ratios file (``MagCache(ratios=path)``) with the recorded defaults."""
    save_ratios(path, ratios, source=source, **{**DEFAULTS, **defaults})


def ship(key: str, ratios: np.ndarray, source: str, **defaults: Any) -> None:
    """Record ``ratios`` under ``key`` in :data:`CALIBRATED_FILE` (what ``magcache_defaults`` finds)."""
    table = {}
    if os.path.isfile(CALIBRATED_FILE):
        with open(CALIBRATED_FILE) as f:
            table = json.load(f)
    entry = {"source": source, "steps": int(ratios.shape[1]), "ratios": np.round(ratios, 5).tolist()}
    table[key] = {**entry, **DEFAULTS, **defaults}
    with open(CALIBRATED_FILE, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


# --------------------------------------------------------------------------------------------------------
# TeaCache

#: The polynomial's order (TeaCache's published ones are all 4th-order).
TEACACHE_ORDER = 4


def teacache_steps_needed() -> int:
    """Steps a TeaCache calibration needs: one more than the fit's points (step 0 has no change)."""
    return TEACACHE_ORDER + 2


def fit_teacache(report: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(coefficients, input changes, output changes) from a TeaCache calibration run's report: the
    4th-order least-squares fit of the prediction's change on the input's, over steps 1..S-1."""
    x = np.asarray(report.ratios, np.float64)[1:]
    y = np.asarray(report.output_ratios, np.float64)[1:]
    if len(x) < TEACACHE_ORDER + 1:
        raise ValueError(
            f"a TeaCache calibration of {len(x) + 1} steps gives {len(x)} changes; a polynomial of order "
            f"{TEACACHE_ORDER} needs {teacache_steps_needed()} steps at least"
        )
    if not (np.isfinite(x).all() and np.isfinite(y).all()) or np.ptp(x) == 0:
        raise ValueError(f"the calibration measured unusable input changes {np.round(x, 5).tolist()}")
    return np.polyfit(x, y, TEACACHE_ORDER), x, y


def calibrate_teacache(pipe: Any, prompt: Any, **call: Any) -> np.ndarray:
    """Run ``pipe(prompt, **call)`` computing every block; -> its fitted coefficients (highest first)."""
    out = pipe(prompt, cache=TeaCacheCalibration(), **call)
    return fit_teacache(out.cache)[0]


def save_teacache_file(
    path: str, coefficients: np.ndarray, inputs: np.ndarray, outputs: np.ndarray, source: str
) -> None:
    """A coefficients file (``TeaCache(coefficients=path)``, ``--teacache_coefficients``)."""
    entry = {
        "coefficients": [float(c) for c in coefficients],
        "threshold": TEACACHE_THRESHOLD,
        "steps": len(inputs) + 1,
        "input_changes": np.round(inputs, 6).tolist(),
        "output_changes": np.round(outputs, 6).tolist(),
        "source": source,
    }
    write_json(path, entry)
