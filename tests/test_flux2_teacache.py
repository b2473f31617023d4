"""TeaCache on FLUX.2 [klein] from a calibration (no coefficients are published for FLUX.2): the tiny
saved distilled klein folder on ring2 x ulysses2, 8 steps, text to image.

The calibration (``TeaCacheCalibration``) computes every step and records per step the relative L1
change of TeaCache's input (the first double block's modulated image input, FLUX.2's shared image
modulation) and of the prediction; ``fit_teacache`` is ``numpy.polyfit(inputs, outputs, 4)`` of those. A
TeaCache run with the written file then decides as TeaCache's accumulator of that polynomial says, step
by step, from the changes it measured itself (recomputed here on the host), and half the polynomial
decides otherwise on the same changes; its step-1 change is the calibration's (both follow the same full
step 0), which ties the calibration's measure to the cache's. ``jaxdit generate --cache teacache`` (or
``magcache``) without its calibration's file is refused in one line before any weight loads.
"""

from __future__ import annotations

import flux2_klein_tiny as tiny
import jax
import numpy as np
import pytest

from jaxdit import cli
from jaxdit.cache import TeaCache
from jaxdit.cache.calibrate import fit_teacache, load_teacache_file, save_teacache_file
from jaxdit.cache.policies import TeaCacheCalibration
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines.flux2 import Flux2KleinPipeline

pytest.importorskip("diffusers")

STEPS = 8
CALL = dict(
    prompt="a photo of a cat on a mat", height=32, width=48, num_inference_steps=STEPS, seed=0,
    max_sequence_length=40, guidance_scale=1.0, output_type="latent", progress=False,
)  # fmt: skip
FAST = {"xla_backend_optimization_level": 0}
#: The random model's polynomial gives 0.16-0.46 a step; accumulated, 0.8 runs steps 3 and 6 (0 and 7
#: always run) and skips 1, 2, 4 and 5, every sum at least 9% away from it (0.32, 0.69, 0.95 | 0.34, 0.73,
#: 1.19).
THRESHOLD = 0.8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.pipeline(tmp_path_factory.mktemp("flux2teacache") / "klein")


@pytest.fixture(scope="module")
def pipe(folder):
    mesh = ParallelConfig(ring=2, ulysses=2).make_mesh(jax.devices()[:4])
    return Flux2KleinPipeline.from_pretrained(folder, mesh, compiler_options=FAST)


def _accumulator(changes, coefficients, threshold):
    """TeaCache's decisions from its changes (step 0 and the last forced): True = every block ran."""
    poly, acc, ran = np.poly1d(coefficients), 0.0, []
    for i, change in enumerate(changes):
        if i in (0, len(changes) - 1):
            ran.append(True)
            acc = 0.0
            continue
        acc += poly(change)
        ran.append(not acc < threshold)
        acc = 0.0 if ran[-1] else acc
    return ran


def test_klein_teacache_from_a_calibrated_file_decides_by_its_polynomial(pipe, tmp_path):
    calibration = pipe(cache=TeaCacheCalibration(), **CALL)
    assert calibration.cache.ran.all() and calibration.cache.devices_agree
    path = str(tmp_path / "klein.json")
    coefficients, inputs, outputs = fit_teacache(calibration.cache)
    save_teacache_file(path, coefficients, inputs, outputs, source="tests/test_flux2_teacache.py")
    entry = load_teacache_file(path)
    np.testing.assert_allclose(entry["coefficients"], np.polyfit(inputs, outputs, 4), rtol=1e-4)
    np.testing.assert_allclose(inputs, calibration.cache.ratios[1:], rtol=1e-5)

    got = pipe(cache=TeaCache(threshold=THRESHOLD, coefficients=path), **CALL).cache
    print(f"ran {got.ran.astype(int)}, changes {np.round(got.ratios, 4)}")
    assert got.devices_agree
    assert got.ran.tolist() == _accumulator(got.ratios, entry["coefficients"], THRESHOLD)
    assert 0 < got.ran.sum() < STEPS - 1  # it skipped steps, and not all of them
    np.testing.assert_allclose(got.ratios[1], calibration.cache.ratios[1], rtol=1e-5)
    assert _accumulator(got.ratios, np.asarray(entry["coefficients"]) / 2, THRESHOLD) != got.ran.tolist()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cache", "teacache"], "--calibrate_teacache FILE, then pass --teacache_coefficients FILE"),
        (["--cache", "magcache"], "--calibrate_magcache FILE, then pass --magcache_ratios FILE"),
    ],
    ids=["teacache", "magcache"],
)
def test_cli_refuses_an_uncalibrated_cache_in_one_line(folder, tmp_path, capsys, flags, message):
    """Before any weight loads (the family's check), nothing written."""
    out = tmp_path / "never.png"
    argv = ["generate", "--weights", str(folder), "--prompt", "a cat", "--height", "32", "--width", "48"]
    assert cli.main([*argv, "--steps", "8", *flags, "--output", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "has no published numbers for FLUX.2" in err[-1] and message in err[-1], err
    assert not out.exists()
