"""FLUX.2 [klein] through ``jaxdit generate``: tiny ``Flux2KleinPipeline`` folders saved by diffusers
(random weights, offline tokenizer; ``tests/flux2_klein_tiny.py``) from a prompt, and from a prompt plus
two reference pictures, to a PNG on 4 emulated devices, against diffusers running the reloaded folder
with the project's noise (numpy ``default_rng(seed).standard_normal`` in the packed latent grid [B, 16,
H/4, W/4], diffusers' ``latents``): the distilled model on ulysses2 x ring2, the base model's CFG on
cfg2 x ulysses2, the distilled model with and without the pictures on pipefusion2 x ulysses2; a distilled
model's ``--use_cfg_parallel`` and a patch count that does not divide the latent rows refused in one line.
diffusers' run of each (folder, guidance, pictures) is computed once and shared by the meshes.

The run's latents (diffusers' ``output_type="latent"``: de-normalised, un-patchified) are read from the
CLI's own generation, so one run gives both the latents and the PNG it wrote.
"""

from __future__ import annotations

import flux2_klein_tiny as tiny
import numpy as np
import pytest
from PIL import Image

import jaxdit.generate as generate_module
from jaxdit import cli
from jaxdit.pipelines import latents as latent_ops

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT = "a photo of a cat on a mat"
H, W, STEPS, SEED, TEXT = 32, 48, 3, 5, 40
LATENT_REL, PNG_STEPS = 1e-4, 1.5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2")
    distilled = tiny.pipeline(root / "klein")
    base = tiny.base_copy(distilled, root / "klein-base")
    rng = np.random.default_rng(7)
    pictures = []
    for k in range(2):  # 66 x 70 pixels, centre-cropped to 64 x 68 (multiples of the VAE factor x 2)
        path = root / f"ref{k}.png"
        Image.fromarray(rng.integers(0, 256, (70, 66, 3), dtype=np.uint8)).save(path)
        pictures.append(path)
    return distilled, base, pictures


@pytest.fixture(scope="module")
def diffusers_runs():
    """diffusers' (latents, pixels) per (folder, guidance, pictures), computed once for every mesh."""
    return {}


def _reference(runs, folder, guidance: float, images=()):
    key = (str(folder), guidance, tuple(map(str, images)))
    if key in runs:
        return runs[key]
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(folder)
    noise = torch.from_numpy(latent_ops.initial_noise(SEED, (1, 16, H // 4, W // 4)))
    call = dict(
        prompt=PROMPT, height=H, width=W, num_inference_steps=STEPS, guidance_scale=guidance,
        latents=noise, max_sequence_length=TEXT,
    )  # fmt: skip
    if images:
        call["image"] = [Image.open(p).convert("RGB") for p in images]
    with torch.no_grad():
        latents = pipe(output_type="latent", **call).images.numpy()
        pixels = pipe(output_type="np", **call).images[0]
    runs[key] = latents, pixels
    return runs[key]


def _argv(folder, guidance: float, *extra: str) -> list[str]:
    argv = ["generate", "--weights", str(folder), "--prompt", PROMPT, "--height", str(H), "--width", str(W)]
    argv += ["--steps", str(STEPS), "--seed", str(SEED), "--guidance_scale", str(guidance)]
    return argv + ["--max_sequence_length", str(TEXT), *extra]


def _check(monkeypatch, runs, folder, tmp_path, guidance: float, mesh: list[str], images=()):
    results = []
    real = generate_module.generate
    monkeypatch.setattr(generate_module, "generate", lambda p, r: results.append(real(p, r)) or results[-1])
    extra = [a for p in images for a in ("--image", str(p))]
    assert cli.main([*_argv(folder, guidance, *mesh, *extra), "--output", str(tmp_path / "x.png")]) == 0
    latents, png = results[0].latents, np.asarray(Image.open(tmp_path / "x.png"), np.float32)
    want_latents, want_pixels = _reference(runs, folder, guidance, images)
    assert latents.shape == want_latents.shape == (1, 4, H // 2, W // 2)
    rel = np.linalg.norm(latents - want_latents) / np.linalg.norm(want_latents)
    worst = np.abs(png - want_pixels * 255).max()
    print(f"{' '.join(mesh)} refs={len(images)}: latents {rel:.2e} relative, PNG {worst:.2f}/255")
    assert rel < LATENT_REL, rel
    assert png.shape == (H, W, 3) and worst <= PNG_STEPS, worst
    return latents


ULYSSES2_RING2 = ["--ulysses_degree", "2", "--ring_degree", "2"]
#: Every step a warm-up step: PipeFusion's synchronous steps are the serial forward (its stale-K/V phase
#: is tested against a serial reference in tests/test_flux2_pipefusion.py); the default 4 patches of 2
#: latent rows, each carrying a chunk of the text and of the reference tokens.
PIPEFUSION2_ULYSSES2 = ["--pipefusion_parallel_degree", "2", "--ulysses_degree", "2"]
PIPEFUSION2_ULYSSES2 += ["--warmup_steps", str(STEPS)]


@pytest.mark.parametrize(
    "which, guidance, mesh, references",
    [
        (0, 4.0, ULYSSES2_RING2, False),
        (0, 1.0, ULYSSES2_RING2, True),
        (0, 4.0, PIPEFUSION2_ULYSSES2, False),
        (0, 1.0, PIPEFUSION2_ULYSSES2, True),
        (1, 3.0, ["--use_cfg_parallel", "--ulysses_degree", "2"], False),
    ],
    ids=[
        "distilled-ulysses2-ring2",
        "distilled-two-references-ulysses2-ring2",
        "distilled-pipefusion2-ulysses2",
        "distilled-two-references-pipefusion2-ulysses2",
        "base-cfg2-ulysses2",
    ],
)
def test_cli_klein_matches_diffusers(
    folders, diffusers_runs, tmp_path, monkeypatch, which, guidance, mesh, references
):
    images = folders[2] if references else ()
    _check(monkeypatch, diffusers_runs, folders[which], tmp_path, guidance, mesh, images=images)


@pytest.mark.parametrize(
    "which, flags, message",
    [
        (0, ["--use_cfg_parallel"], "distilled FLUX.2 klein, which runs without it"),
        (0, [*PIPEFUSION2_ULYSSES2[:4], "--num_pipeline_patch", "3"], "does not divide the 8 rows"),
    ],
    ids=["distilled-cfg-parallel", "pipefusion-patches"],
)
def test_cli_refuses_in_one_line(folders, tmp_path, capsys, which, flags, message):
    out = tmp_path / "never.png"
    assert cli.main([*_argv(folders[which], 3.0, *flags), "--output", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err and message in err[-1], err
    assert not out.exists()


class _Reached(Exception):
    """Raised by the stand-in builder once it has the CLI's options (nothing loads)."""


@pytest.mark.parametrize("flag", [True, False], ids=["encoder-on-mesh", "default"])
def test_cli_encoder_on_mesh_reaches_the_builder(folders, tmp_path, monkeypatch, flag):
    """``--encoder_on_mesh`` is handed to the folder's builder as ``encoder_on_mesh=True`` (the
    placement itself: tests/test_flux2_dev_cli.py's on-mesh run); without it the builder gets none."""
    import functools

    from jaxdit.pipelines.flux2 import Flux2KleinPipeline

    got = {}
    loads = Flux2KleinPipeline.from_pretrained.__func__

    @functools.wraps(loads)  # the builder's own signature: the CLI checks it takes the option
    def record(cls, *args, **kwargs):
        got.update(kwargs)
        raise _Reached

    monkeypatch.setattr(Flux2KleinPipeline, "from_pretrained", classmethod(record))
    argv = [*_argv(folders[0], 1.0, "--ulysses_degree", "2", "--tensor_parallel_degree", "2")]
    with pytest.raises(_Reached):
        cli.main([*argv, *(["--encoder_on_mesh"] if flag else []), "--output", str(tmp_path / "x.png")])
    assert got.get("encoder_on_mesh", False) is flag
    assert "offload_encoders" not in got


def test_cli_encoder_on_mesh_with_offload_is_refused(folders, tmp_path, capsys):
    out = tmp_path / "never.png"
    argv = [*_argv(folders[0], 1.0, "--encoder_on_mesh", "--offload_encoders"), "--output", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "--encoder_on_mesh shards it over the mesh: give one of them" in err[-1], err
    assert not out.exists()
