"""FLUX.2 [dev] through ``jaxdit generate``: a tiny ``Flux2Pipeline`` folder saved by diffusers (random
weights, Mistral3 text encoder, offline processor folder; ``tests/flux2_dev_tiny.py``) from a prompt, and
from a prompt plus two reference pictures, to a PNG on 4 emulated devices (ulysses2 x ring2 and
pipefusion2 x ulysses2), against
diffusers running the reloaded folder with the project's noise (numpy ``default_rng(seed).standard_normal``
in the packed latent grid [B, 16, H/4, W/4], diffusers' ``latents``); the flags of a second guidance
branch refused in one line (dev is guidance-distilled).

diffusers loads the folder without its ``tokenizer`` and is then given ``flux2_dev_tiny.text_processor``
(transformers' ``ProcessorMixin`` over the folder's tokenizer and template), since ``PixtralProcessor``
needs torchvision, which is not installed; everything else (Mistral3, transformer, VAE, scheduler) it
reads from the folder. Diffusers' reference is computed once per set of pictures (fp32) and shared by
the meshes.

The latents compared are what diffusers hands its VAE (de-normalised, un-patchified; jaxdit's
``output_type="latent"``), read from the CLI's own generation, so one run gives both the latents and the
PNG it wrote.
"""

from __future__ import annotations

import functools
import json
import shutil

import flux2_dev_tiny as tiny
import numpy as np
import pytest
from PIL import Image

import jaxdit.generate as generate_module
from jaxdit import cli
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.flux2_dev import Flux2Pipeline
from jaxdit.text_encoders.flux2_dev_prompt import SYSTEM_MESSAGE

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT = "a photo of a cat on a mat"
H, W, STEPS, SEED, TEXT, GUIDANCE = 32, 48, 3, 5, 64, 3.5
LATENT_REL, PNG_STEPS = 1e-4, 1.5
FAST = {"xla_backend_optimization_level": 0}
ULYSSES2_RING2 = ["--ulysses_degree", "2", "--ring_degree", "2"]
#: Every step a warm-up step, as in tests/test_flux2_cli.py: PipeFusion's synchronous steps are the serial
#: forward, so diffusers is the reference (the stale-K/V phase is tested against a serial reference in
#: tests/test_flux2_pipefusion.py); the default 4 patches of 2 latent rows, each with a chunk of the text
#: and of the reference tokens, and dev's guidance input on every stage.
PIPEFUSION2_ULYSSES2 = ["--pipefusion_parallel_degree", "2", "--ulysses_degree", "2"]
PIPEFUSION2_ULYSSES2 += ["--warmup_steps", str(STEPS)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2dev")
    path = tiny.pipeline(root / "dev")
    rng = np.random.default_rng(9)
    pictures = []
    for k, (h, w) in enumerate(((70, 66), (64, 84))):  # centre-cropped to multiples of 4 (VAE factor 2 x 2)
        picture = root / f"ref{k}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(picture)
        pictures.append(picture)
    return path, pictures


@pytest.fixture(scope="module")
def diffusers_runs():
    """diffusers' (latents, pixels) per set of pictures, computed once for every mesh."""
    return {}


def _reference(runs, path, images=()):
    """diffusers' Flux2Pipeline from the reloaded folder: (VAE latents, pixels in [0, 1])."""
    key = tuple(map(str, images))
    if key not in runs:
        runs[key] = _run_diffusers(path, images)
    return runs[key]


def _run_diffusers(path, images):
    pipe = diffusers.Flux2Pipeline.from_pretrained(path, tokenizer=None)  # every other part from the folder
    pipe.tokenizer = tiny.text_processor(path)
    noise = torch.from_numpy(latent_ops.initial_noise(SEED, (1, 16, H // 4, W // 4)))
    call = dict(
        prompt=PROMPT, height=H, width=W, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
        latents=noise, max_sequence_length=TEXT,
    )  # fmt: skip
    if images:
        call["image"] = [Image.open(p).convert("RGB") for p in images]
    final = {}

    def keep(pipe, step, t, tensors):  # the last step's tokens: what the decode below starts from
        final["tokens"] = tensors["latents"].clone()
        return tensors

    with torch.no_grad():
        pixels = pipe(output_type="np", callback_on_step_end=keep, **call).images[0]
        tokens = final["tokens"]
        # What Flux2Pipeline does to its final tokens before vae.decode.
        grid = pipe._unpack_latents_with_ids(tokens, pipe._prepare_latent_ids(noise))
        mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
        latents = pipe._unpatchify_latents(grid * std + mean).numpy()
    return latents, pixels


def _argv(path, *extra: str) -> list[str]:
    argv = ["generate", "--weights", str(path), "--prompt", PROMPT, "--height", str(H), "--width", str(W)]
    argv += ["--steps", str(STEPS), "--seed", str(SEED), "--guidance_scale", str(GUIDANCE)]
    return argv + ["--max_sequence_length", str(TEXT), *extra]


@pytest.mark.parametrize(
    "references, placement, mesh",
    [
        (0, "on-mesh", ULYSSES2_RING2),
        (2, "offloaded", ULYSSES2_RING2),
        (0, "one-device", PIPEFUSION2_ULYSSES2),
        (2, "one-device", PIPEFUSION2_ULYSSES2),
    ],
    ids=[
        "prompt-encoder-on-mesh-ulysses2-ring2",
        "two-references-encoder-offloaded-ulysses2-ring2",
        "prompt-pipefusion2-ulysses2",
        "two-references-pipefusion2-ulysses2",
    ],
)
def test_cli_dev_matches_diffusers(
    folder, diffusers_runs, tmp_path, monkeypatch, references, placement, mesh
):
    """The text encoder's three placements: sharded over the mesh (--encoder_on_mesh), on one device
    with its weights in host memory between prompts (--offload_encoders), and on one device (default)."""
    path, pictures = folder
    images = pictures[:references]
    results = []
    real = generate_module.generate
    monkeypatch.setattr(generate_module, "generate", lambda p, r: results.append(real(p, r)) or results[-1])
    loads = Flux2Pipeline.from_pretrained.__func__

    @functools.wraps(loads)  # the builder's own signature: the CLI checks it takes the placement flags
    def quick(cls, *args, **kwargs):  # XLA's backend optimisations off: compiles in a fraction of the time
        assert kwargs.get("encoder_on_mesh", False) is (placement == "on-mesh")
        return loads(cls, *args, **{**kwargs, "compiler_options": FAST})

    monkeypatch.setattr(Flux2Pipeline, "from_pretrained", classmethod(quick))
    extra = [a for p in images for a in ("--image", str(p))]
    if placement == "offloaded":
        extra.append("--offload_encoders")
    if placement == "on-mesh":
        extra.append("--encoder_on_mesh")
    assert cli.main([*_argv(path, *mesh, *extra), "--output", str(tmp_path / "x.png")]) == 0
    latents, png = results[0].latents, np.asarray(Image.open(tmp_path / "x.png"), np.float32)
    want_latents, want_pixels = _reference(diffusers_runs, path, images)
    assert latents.shape == want_latents.shape == (1, 4, H // 2, W // 2)
    rel = np.linalg.norm(latents - want_latents) / np.linalg.norm(want_latents)
    worst = np.abs(png - want_pixels * 255).max()
    print(f"dev {' '.join(mesh)} refs={references}: latents {rel:.2e} relative, PNG {worst:.2f}/255")
    assert rel < LATENT_REL, rel
    assert png.shape == (H, W, 3) and worst <= PNG_STEPS, worst


def test_system_message_is_diffusers():
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE as DIFFUSERS

    assert SYSTEM_MESSAGE == DIFFUSERS


@pytest.mark.parametrize(
    "flags",
    [["--negative_prompt", "blurry"], ["--true_cfg_scale", "4"], ["--use_cfg_parallel"]],
    ids=["negative-prompt", "true-cfg-scale", "cfg-parallel"],
)
def test_cli_refuses_a_second_branch_in_one_line(folder, tmp_path, capsys, flags):
    out = tmp_path / "never.png"
    assert cli.main([*_argv(folder[0], *flags), "--output", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "FLUX.2 [dev] is guidance-distilled" in err[-1] and flags[0] in err[-1], err
    assert not out.exists()


def test_cli_refuses_a_klein_transformer_in_a_dev_folder(folder, tmp_path, capsys):
    """Told from the transformer's config.json, before any weight is read."""
    wrong = shutil.copytree(folder[0], tmp_path / "wrong")
    config = json.loads((wrong / "transformer" / "config.json").read_text())
    (wrong / "transformer" / "config.json").write_text(json.dumps({**config, "guidance_embeds": False}))
    out = tmp_path / "never.png"
    assert cli.main([*_argv(wrong), "--output", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "this FLUX.2 transformer has no guidance embedding" in err[-1], err
    assert not out.exists()
