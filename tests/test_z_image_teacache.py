"""TeaCache on Z-Image from a calibration (no coefficients are published): the tiny saved
``ZImagePipeline`` folder on ring2 x ulysses2, 8 Turbo steps.

The calibration (``TeaCacheCalibration``) computes every step, so its latents are the uncached run's, and
records per step the relative L1 change of TeaCache's input (the first joint block's modulated input,
as TeaCache4Lumina2 reads it) and of the prediction; ``fit_teacache`` is ``numpy.polyfit(inputs,
outputs, 4)`` of those. A TeaCache run with the written file then decides as TeaCache's accumulator of
that polynomial says, step by step, from the changes it measured itself (recomputed here on the host);
its step-1 change is the calibration's (both follow the same full step 0), which ties the calibration's
measure to the cache's. Then ``jaxdit generate --calibrate_teacache FILE`` and ``--teacache_coefficients
FILE`` once end to end, and TeaCache without coefficients refused in one line naming the calibration.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import z_image_tiny as tiny

from jaxdit import cli
from jaxdit.cache import TeaCache
from jaxdit.cache.calibrate import fit_teacache, load_teacache_file, save_teacache_file
from jaxdit.cache.policies import TeaCacheCalibration
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines.z_image import ZImagePipeline

pytest.importorskip("diffusers")

PROMPT = "a photo of a cat on a mat"
STEPS = 8
CALL = dict(
    height=32, width=48, num_inference_steps=STEPS, guidance_scale=0.0, seed=0, output_type="latent",
    progress=False,
)  # fmt: skip
FAST = {"xla_backend_optimization_level": 0}
#: The random model's rescaled changes are ~1.1-1.4 a step: 1.5 skips some steps and not others.
THRESHOLD = 1.5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zimage") / "Z-Image-tiny"
    tiny.pipeline(folder)
    return folder


@pytest.fixture(scope="module")
def pipe(folder):
    mesh = ParallelConfig(ring=2, ulysses=2).make_mesh(jax.devices()[:4])
    return ZImagePipeline.from_pretrained(folder, mesh, compiler_options=FAST)


@pytest.fixture(scope="module")
def calibration(pipe, tmp_path_factory):
    out = pipe(PROMPT, cache=TeaCacheCalibration(), **CALL)
    path = str(tmp_path_factory.mktemp("teacache") / "z-image.json")
    coefficients, inputs, outputs = fit_teacache(out.cache)
    save_teacache_file(path, coefficients, inputs, outputs, source="tests/test_z_image_teacache.py")
    return out, path


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


def test_calibration_computes_every_step_and_fits_the_polynomial(pipe, calibration):
    out, path = calibration
    report = out.cache
    assert report.ran.all() and report.devices_agree
    np.testing.assert_array_equal(out.latents, pipe(PROMPT, **CALL).latents)  # nothing skipped
    with open(path) as f:
        entry = json.load(f)
    x, y = np.asarray(entry["input_changes"]), np.asarray(entry["output_changes"])
    assert entry["steps"] == STEPS and len(x) == len(y) == STEPS - 1
    np.testing.assert_allclose(x, report.ratios[1:], rtol=1e-5)
    np.testing.assert_allclose(y, report.output_ratios[1:], rtol=1e-5)
    assert np.all((x > 0.1) & (y > 0.1)), (x, y)  # the random model's steps change a lot
    # The file's polynomial is the least-squares fit of its points. Compared by the values it predicts at
    # them: a 4th-order fit through 7 points is ill-conditioned, so its coefficients move by ~1e-4 when
    # the points move in their 7th digit (as the stored changes do), while its values do not.
    fitted = np.polyval(entry["coefficients"], x)
    np.testing.assert_allclose(fitted, np.polyval(np.polyfit(x, y, 4), x), rtol=1e-5)
    assert not np.allclose(fitted, np.polyval(np.polyfit(x, y, 3), x), rtol=1e-3)  # the order is 4
    assert load_teacache_file(path)["threshold"] == 0.4  # the recorded default: TeaCache4FLUX's


def test_teacache_from_the_file_decides_by_its_polynomial(pipe, calibration):
    out, path = calibration
    got = pipe(PROMPT, cache=TeaCache(threshold=THRESHOLD, coefficients=path), **CALL).cache
    coefficients = load_teacache_file(path)["coefficients"]
    print(f"ran {got.ran.astype(int)}, changes {np.round(got.ratios, 4)}")
    assert got.devices_agree
    assert got.ran.tolist() == _accumulator(got.ratios, coefficients, THRESHOLD)
    assert 0 < got.ran.sum() < STEPS - 1  # it skipped steps, and not all of them
    # Both runs computed step 0 in full: the input's change at step 1 is the calibration's.
    np.testing.assert_allclose(got.ratios[1], out.cache.ratios[1], rtol=1e-5)
    # The decisions depend on the polynomial: half of it decides otherwise on the same changes.
    assert _accumulator(got.ratios, np.asarray(coefficients) / 2, THRESHOLD) != got.ran.tolist()


def test_teacache_without_coefficients_names_the_calibration(pipe):
    with pytest.raises(ValueError, match="--calibrate_teacache FILE.*--teacache_coefficients FILE"):
        pipe(PROMPT, cache=TeaCache(), **CALL)


def test_cli_calibrates_then_runs_teacache(folder, calibration, tmp_path, capsys):
    """On one device: the calibration measures the changes ring2 x ulysses2 measured (same seed)."""
    poly = tmp_path / "poly.json"
    argv = ["generate", "--weights", str(folder), "--prompt", PROMPT, "--height", "32", "--width", "48"]
    argv += ["--steps", str(STEPS), "--guidance_scale", "0", "--seed", str(CALL["seed"])]
    assert cli.main([*argv, "--calibrate_teacache", str(poly), "--output", str(tmp_path / "a.npy")]) == 0
    printed = capsys.readouterr().out
    assert f"TeaCache polynomial fitted to {STEPS - 1} step changes written to {poly}" in printed
    one, mesh = load_teacache_file(str(poly)), load_teacache_file(calibration[1])
    assert len(one["coefficients"]) == 5
    for key in ("input_changes", "output_changes"):
        np.testing.assert_allclose(one[key], mesh[key], rtol=1e-4)
    cached = [
        "--cache",
        "teacache",
        "--teacache_coefficients",
        str(poly),
        "--cache_threshold",
        str(THRESHOLD),
    ]
    assert cli.main([*argv, *cached, "--output", str(tmp_path / "b.npy")]) == 0
    printed = capsys.readouterr().out
    assert f"TeaCache (threshold {THRESHOLD:g}): " in printed and "steps ran every block" in printed, printed
    assert f"{STEPS} of {STEPS} steps ran" not in printed  # it skipped

    # Without coefficients: one line, before any weight loads, nothing written.
    never = tmp_path / "never.png"
    assert cli.main([*argv, "--cache", "teacache", "--output", str(never)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "--calibrate_teacache FILE, then pass --teacache_coefficients FILE" in err[-1], err
    assert not never.exists()
    # Too few steps for a 4th-order fit: refused before anything runs.
    short = [a if a != str(STEPS) else "4" for a in argv]
    assert cli.main([*short, "--calibrate_teacache", str(tmp_path / "x.json"), "--output", str(never)]) != 0
    assert "needs --steps 6 or more, got 4" in capsys.readouterr().err
