"""``jaxdit generate --weights FOLDER --prompt ...``: flag checks (before jax) and prompt -> PNG / MP4 runs."""

import shutil

import numpy as np
import pytest
import tiny_pipelines
import tolerance as tol
from PIL import Image

from jaxdit import cli
from jaxdit.generate import GenerateRequest, check_request


def _request(**kwargs):
    return GenerateRequest(**kwargs)


@pytest.fixture(scope="module")
def flux_folder():
    return str(tiny_pipelines.flux_folder())


@pytest.fixture(scope="module")
def wan_folder():
    return str(tiny_pipelines.wan_folder())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "give --prompt"),
        (dict(prompt="a", prompt_embeds="x.npz"), "--prompt_embeds and a pipeline folder"),
        (
            dict(prompt="a", pipefusion_parallel_degree=2, num_pipeline_patch=4, height=24, width=32),
            "does not divide the 6 rows",
        ),
        (dict(prompt="a", model="wan2.1-t2v-14b"), "does not match"),
        (dict(prompt="a", height=18, width=32), "multiples of 4"),
        (dict(prompt="a", output="x.mp4"), r"must end in \.png"),
        # The owners come from the registry (every video family that takes the flags).
        (dict(prompt="a", num_frames=9), r"--num_frames and --flow_shift apply to Wan\b.* models"),
        (dict(prompt="a", use_cfg_parallel=True), "needs classifier-free guidance"),
        (dict(prompt="a", image="x.png"), "for models that take a picture"),
        (dict(prompt="a", max_sequence_length=0), r"must be in 1\.\.512"),
        (dict(prompt="a", max_sequence_length=513), r"must be in 1\.\.512 .*, got 513"),
    ],
)
def test_flux_folder_request_errors(flux_folder, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_request(_request(weights=flux_folder, **kwargs))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt="a", num_frames=6), "4n \\+ 1"),
        (dict(prompt="a", height=40), "multiples of 16"),
        (dict(prompt="a", true_cfg_scale=2.0), "--guidance_scale"),
        (dict(prompt="a", output="x.png"), r"\.mp4 / \.gif"),
        (dict(prompt="a", model="flux-dev"), "does not match"),
        (dict(prompt="a", use_cfg_parallel=True, guidance_scale=1.0), "guidance_scale > 1"),
    ],
)
def test_wan_folder_request_errors(wan_folder, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_request(_request(weights=wan_folder, **kwargs))


def test_mp4_without_pyav_is_refused_before_the_run(wan_folder, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "av" else real(name, *a)
    )
    with pytest.raises(ValueError, match="writing MP4 needs PyAV"):
        check_request(_request(weights=wan_folder, prompt="a"))  # the default output is video.mp4
    check_request(_request(weights=wan_folder, prompt="a", output="clip.gif"))  # a GIF needs no PyAV


def test_half_downloaded_folder_names_the_missing_parts(tmp_path, flux_folder):
    broken = shutil.copytree(
        flux_folder, tmp_path / "flux", ignore=shutil.ignore_patterns("vae", "tokenizer_2")
    )
    with pytest.raises(ValueError, match="missing: vae/, tokenizer_2/"):
        check_request(_request(weights=str(broken), prompt="a"))


def test_image_and_sequence_length_need_a_pipeline_folder():
    with pytest.raises(ValueError, match="need a pipeline folder"):
        check_request(_request(prompt="7", max_sequence_length=16))


def test_cli_flux_folder_prompt_to_png(flux_folder, tmp_path, capsys):
    out = tmp_path / "cube.png"
    argv = [
        "generate",
        "--weights",
        flux_folder,
        "--prompt",
        "a small red cube",
        "--height",
        "16",
        "--width",
        "24",
    ]
    argv += ["--steps", "2", "--ring_degree", "2", "--ulysses_degree", "2", "--max_sequence_length", "8"]
    assert cli.main([*argv, "--output", str(out)]) == 0
    assert np.asarray(Image.open(out)).shape == (16, 24, 3)
    printed = capsys.readouterr().out
    assert "(flux, diffusers layout)" in printed and f"wrote {out}" in printed


def test_cli_wan_folder_prompt_to_mp4(wan_folder, tmp_path):
    av = pytest.importorskip("av")
    out = tmp_path / "clip.mp4"
    argv = [
        "generate",
        "--weights",
        wan_folder,
        "--prompt",
        "a small red cube",
        "--negative_prompt",
        "static",
    ]
    argv += ["--height", "32", "--width", "48", "--num_frames", "5", "--steps", "2", "--use_cfg_parallel"]
    argv += ["--ulysses_degree", "2", "--max_sequence_length", "8", "--output", str(out)]
    assert cli.main(argv) == 0
    with av.open(str(out)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 48, 3)


def test_cli_flux_folder_with_pipefusion_matches_the_serial_run(flux_folder, tmp_path, capsys):
    """PipeFusion from a downloaded folder: prompt -> latents on pipefusion2 x ulysses2 with every step a
    warm-up step (synchronous: the serial result), against the same call on one device."""
    argv = ["generate", "--weights", flux_folder, "--prompt", "a small red cube", "--height", "24"]
    argv += ["--width", "32", "--steps", "2", "--max_sequence_length", "8", "--seed", "3"]
    assert cli.main([*argv, "--output", str(tmp_path / "serial.npy")]) == 0
    pf = ["--pipefusion_parallel_degree", "2", "--ulysses_degree", "2", "--warmup_steps", "2"]
    assert cli.main([*argv, *pf, "--output", str(tmp_path / "pf.npy")]) == 0, capsys.readouterr().err
    serial, piped = np.load(tmp_path / "serial.npy"), np.load(tmp_path / "pf.npy")
    tol.check(piped, serial, tol.SAME_SEED, "PipeFusion warm-up only (pf2 x ulysses2) vs one device")
