"""MagCache (calibrated here), TaylorSeer and DBCache through Wan's hooks (one stack of blocks, video
tokens), with the tiny random Wan of tests/wan_tiny.py: on ring2 x ulysses2 every device decides alike,
as one device does, and the latents are one device's to fp32 rounding (45 video tokens over 4 shards:
padding included).
"""

from __future__ import annotations

import numpy as np
import pytest
import tolerance as tol

pytest.importorskip("torch")
pytest.importorskip("diffusers")
from test_cache_diffusers import WAN_STEPS, _wan_call  # noqa: E402

from jaxdit.cache import DBCache, MagCache, TaylorSeer  # noqa: E402
from jaxdit.cache.calibrate import ratios_of, save_calibration_file  # noqa: E402
from jaxdit.cache.magcache import MagCacheCalibration  # noqa: E402

MESH = (("ring", 2), ("ulysses", 2))


def test_wan_new_caches_on_ring2_ulysses2_equal_one_device(tmp_path):
    calibration = _wan_call((), MagCacheCalibration(), guidance=1.0).cache
    ratios = ratios_of(calibration)
    assert ratios.shape == (1, WAN_STEPS) and ratios[0, 0] == 1.0 and calibration.full_steps == WAN_STEPS
    path = str(tmp_path / "wan_ratios.json")
    save_calibration_file(path, ratios, source="tests/test_cache_new_wan.py")
    caches = {
        "magcache": MagCache(ratios=path, threshold=0.5, max_skips=1, retention=0.0),
        "taylorseer": TaylorSeer(interval=2, order=1, warmup=1),
        "dbcache": DBCache(threshold=1.2, fn=1, bn=0, warmup=1, max_continuous=1),
    }
    for name, cache in caches.items():
        sharded, single = _wan_call(MESH, cache, guidance=1.0), _wan_call((), cache, guidance=1.0)
        print(f"Wan {name}: {sharded.cache.describe()} {sharded.cache.ran.astype(int)}")
        assert sharded.cache.devices == 4 and sharded.cache.devices_agree
        assert sharded.cache.ran.tolist() == single.cache.ran.tolist()
        assert 0 < sharded.cache.full_steps < WAN_STEPS, name
        assert np.isfinite(sharded.latents).all()
        tol.check(
            sharded.latents, single.latents, tol.SAME_SEED, f"Wan {name}: ring2 x ulysses2 vs one device"
        )
