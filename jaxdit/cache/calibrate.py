"""MagCache's calibration: one generation that computes every block and records, at each step, the
magnitude ratio ``gamma_t = mean over tokens of ||r_t|| / ||r_{t-1}||`` of the residual of all blocks
(MagCache, arXiv 2506.09045, section 3; the authors' ``magcache_calibration`` flag). The ratios are
nearly the same for any prompt and seed of a model, so one run records them for good:

    jaxdit generate --model tiny-digits --calibrate_magcache ratios.json     # then --magcache_ratios
    calibrate(pipe, "0123456789", num_inference_steps=20, ...)               # the same from Python

``ratios.json`` (:func:`save_calibration_file`) is what ``MagCache(ratios=...)`` and ``--magcache_ratios``
read; jaxdit's own calibrations of its bundled model live in ``jaxdit/cache/ratios/calibrated.json``
(``scripts/calibrate_magcache.py`` writes them). With guidance the ratio is measured over both branches
together (one decision per step covers both, as everywhere in jaxdit's caches).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jaxdit.cache.magcache import MagCacheCalibration, save_ratios

__all__ = ["CALIBRATED_FILE", "calibrate", "ratios_of", "save_calibration_file", "ship"]

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
