"""TeaCache, MagCache, DBCache and TaylorSeer on HunyuanVideo 1.5 (``models/hunyuan_video15_cache_hooks.py``
through the family's cache seam), on the tiny saved ``HunyuanVideo15Pipeline`` folder with three
dual-stream blocks (DBCache F1B1 keeps a middle one to cache), from embeddings, 8 steps of CFG.

No TeaCache polynomial or MagCache ratios are published for HunyuanVideo 1.5, so both come from their
calibration runs (every block computed; each is the uncached run exactly) written to files as
``--calibrate_teacache`` / ``--calibrate_magcache`` write them. Each cache skips steps here and the run on
cfg2 x ulysses2 (one decision for both guidance branches and every video shard) takes the one-device
run's decisions and latents. diffusers registers none of these caches for this transformer, so the
references are jaxdit's own uncached and one-device runs. Without a calibration's file, TeaCache and
MagCache are refused in one line before any weight loads.
"""

from __future__ import annotations

import hunyuan_video15_folder as hf
import jax
import numpy as np
import pytest
import tolerance as tol

from jaxdit.cache import DBCache, MagCache, TaylorSeer, TeaCache
from jaxdit.cache.calibrate import fit_teacache, ratios_of, save_calibration_file, save_teacache_file
from jaxdit.cache.magcache import MagCacheCalibration
from jaxdit.cache.policies import TeaCacheCalibration
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines.hunyuan_video15 import HunyuanVideo15Pipeline

STEPS = 8
CALL = dict(
    height=32, width=48, num_frames=5, num_inference_steps=STEPS, output_type="latent", progress=False
)
FAST = {"xla_backend_optimization_level": 0}
SOURCE = "tests/test_hunyuan_video15_caches.py"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("hunyuan_video15_caches")
    hf.save(root / "folder", num_layers=3)
    emb = {**hf.embeddings([6], [2]), **hf.embeddings([3], [0], seed=1, prefix="negative_")}

    def make(pc):
        mesh = pc.make_mesh(jax.devices()[: pc.num_devices])
        return HunyuanVideo15Pipeline.from_pretrained(root / "folder", mesh, compiler_options=FAST)

    pipes = {pc.describe(): make(pc) for pc in (ParallelConfig(), ParallelConfig(cfg=2, ulysses=2))}
    run = lambda name, cache=None: pipes[name](**emb, seed=3, cache=cache, **CALL)  # noqa: E731
    return run, root


@pytest.fixture(scope="module")
def plain(case):
    run, _ = case
    return run("single device").latents


@pytest.fixture(scope="module")
def calibrated(case, plain):
    """The two calibrations' files (one device), each run checked against the uncached latents."""
    run, root = case
    tea = run("single device", TeaCacheCalibration())
    mag = run("single device", MagCacheCalibration())
    for out in (tea, mag):
        assert out.cache.ran.all()
        np.testing.assert_array_equal(out.latents, plain)
    coefficients, inputs, outputs = fit_teacache(tea.cache)
    save_teacache_file(str(root / "teacache.json"), coefficients, inputs, outputs, source=SOURCE)
    save_calibration_file(str(root / "magcache.json"), ratios_of(mag.cache), source=SOURCE)
    print(f"teacache changes {np.round(inputs, 4)} -> {np.round(outputs, 4)}")
    print(f"magcache ratios {np.round(ratios_of(mag.cache), 4)}")
    return {"teacache": str(root / "teacache.json"), "magcache": str(root / "magcache.json")}


CACHES = {
    "teacache": lambda files: TeaCache(threshold=1.0, coefficients=files["teacache"]),
    "magcache": lambda files: MagCache(threshold=0.5, ratios=files["magcache"]),
    "dbcache": lambda files: DBCache(threshold=1.1, fn=1, bn=1, warmup=1),
    "taylorseer": lambda files: TaylorSeer(interval=3),
}


@pytest.mark.parametrize("name", list(CACHES))
def test_the_mesh_takes_the_one_device_decisions(case, plain, calibrated, name):
    run, _ = case
    cache = CACHES[name](calibrated)
    want = run("single device", cache)
    print(f"{name}: ran {want.cache.ran.astype(int)}, ratios {np.round(want.cache.ratios, 4)}")
    assert 0 < want.cache.full_steps < STEPS  # some steps skipped, some ran
    assert float(np.abs(want.latents - plain).max()) > 1e-4  # skipping changed the result
    got = run("cfg2 x ulysses2", cache)
    assert got.cache.ran.tolist() == want.cache.ran.tolist() and got.cache.devices_agree
    err = tol.check(got.latents, want.latents, tol.SAME_SEED, f"{name} cfg2 x ulysses2 vs one device")
    print(f"{name}: {want.cache.full_steps}/{STEPS} steps ran, cfg2 x ulysses2 vs one device {err}")
