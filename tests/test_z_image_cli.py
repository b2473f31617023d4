"""Z-Image through ``jaxdit generate``: a tiny ``ZImagePipeline`` folder saved by diffusers (random
weights, offline tokenizer) from a prompt to a PNG on 4 emulated devices, against diffusers running the
reloaded folder with the project's noise (numpy ``default_rng(seed).standard_normal`` in the latent
grid): Turbo's guidance 0 on ulysses2 x ring2 with one prompt, the base model's guidance on cfg2 x ulysses2
with two prompts of different lengths in one run (``--prompt`` repeated: one picture each, written as a
grid), Turbo on pipefusion2 x ulysses2 with the same two prompts; Turbo's ``--use_cfg_parallel`` refused in one line before any weight loads, and several prompts
refused where the family takes one."""

from __future__ import annotations

import numpy as np
import pytest
import z_image_tiny as tiny
from PIL import Image

from jaxdit import cli
from jaxdit.pipelines import latents as latent_ops

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT = "a photo of a cat on a mat"
#: 42 tokens with the chat template (PROMPT: 16): padded to 64 and 32, so the caption mask is in play.
LONG = (
    "a big blue house with a tree at sunset and a small dog on a red mat next to a big red house with a "
    "small cat and a blue tree on a mat"
)
H, W, STEPS, SEED = 32, 48, 3, 5
LATENT_REL, PNG_STEPS = 1e-4, 1.5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zimage") / "Z-Image-tiny"
    tiny.pipeline(folder)
    return folder


def _reference(folder, guidance: float, prompts: list[str]):
    pipe = diffusers.ZImagePipeline.from_pretrained(folder)
    noise = torch.from_numpy(latent_ops.initial_noise(SEED, (len(prompts), 4, H // 2, W // 2)))
    call = dict(height=H, width=W, num_inference_steps=STEPS, guidance_scale=guidance, latents=noise)
    with torch.no_grad():  # diffusers edits the prompt list it is given: a fresh one per call
        latents = pipe(list(prompts), output_type="latent", **call).images.numpy()
        pixels = pipe(list(prompts), output_type="np", **call).images
    return latents, np.asarray(pixels)


def _argv(folder, guidance: float, *mesh: str, prompts=(PROMPT,)) -> list[str]:
    argv = ["generate", "--weights", str(folder), *(a for p in prompts for a in ("--prompt", p))]
    argv += ["--height", str(H), "--width", str(W)]
    return argv + ["--steps", str(STEPS), "--seed", str(SEED), "--guidance_scale", str(guidance), *mesh]


def _check(folder, tmp_path, guidance: float, mesh: list[str], prompts: list[str]):
    argv = _argv(folder, guidance, *mesh, prompts=prompts)
    assert cli.main([*argv, "--output", str(tmp_path / "z.npy")]) == 0
    assert cli.main([*argv, "--output", str(tmp_path / "z.png")]) == 0
    latents, png = np.load(tmp_path / "z.npy"), np.asarray(Image.open(tmp_path / "z.png"), np.float32)
    want_latents, want_pixels = _reference(folder, guidance, prompts)
    assert latents.shape == want_latents.shape == (len(prompts), 4, H // 2, W // 2)
    rel = np.linalg.norm(latents - want_latents) / np.linalg.norm(want_latents)
    # One picture per prompt, side by side on a grid with a 1-pixel border (jaxdit.pipelines.output.grid).
    n = len(prompts)
    assert png.shape == ((H, W, 3) if n == 1 else (H + 2, n * (W + 1) + 1, 3)), png.shape
    pictures = [png] if n == 1 else [png[1 : 1 + H, 1 + i * (W + 1) : 1 + i * (W + 1) + W] for i in range(n)]
    worst = max(np.abs(p - want * 255).max() for p, want in zip(pictures, want_pixels, strict=True))
    print(f"{' '.join(mesh)}, {n} prompt(s): latents {rel:.2e} relative, PNG {worst:.2f}/255")
    assert rel < LATENT_REL, rel
    assert worst <= PNG_STEPS, worst


def test_cli_turbo_ulysses2_ring2_matches_diffusers(folder, tmp_path):
    _check(folder, tmp_path, 0.0, ["--ulysses_degree", "2", "--ring_degree", "2"], [PROMPT])


def test_cli_base_guidance_cfg2_ulysses2_two_prompts_match_diffusers(folder, tmp_path):
    _check(folder, tmp_path, 2.0, ["--use_cfg_parallel", "--ulysses_degree", "2"], [PROMPT, LONG])


def test_cli_several_prompts_refused_where_the_family_takes_one(tmp_path, capsys):
    out = tmp_path / "never.png"
    argv = ["generate", "--model", "tiny-digits", "--prompt", "01", "--prompt", "23", "--output", str(out)]
    assert cli.main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "takes one --prompt per run; 2 were given" in err[-1], err
    assert not out.exists()


def test_cli_turbo_refuses_cfg_parallel(folder, tmp_path, capsys):
    out = tmp_path / "never.png"
    assert cli.main([*_argv(folder, 0.0, "--use_cfg_parallel"), "--output", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "--use_cfg_parallel needs classifier-free guidance" in err[-1], err
    assert not out.exists()


def test_cli_pipefusion2_ulysses2_two_prompts_match_diffusers(folder, tmp_path):
    """Every step a warm-up step: PipeFusion's synchronous steps are the serial forward through the three
    stacks' stage slots (the refiners' one-group attention masked inside the patch attention), with both
    prompts' caption masks."""
    mesh = ["--pipefusion_parallel_degree", "2", "--ulysses_degree", "2", "--warmup_steps", str(STEPS)]
    _check(folder, tmp_path, 0.0, mesh, [PROMPT, LONG])


def test_cli_transformer_and_embeddings_file(folder, tmp_path):
    """A transformer checkpoint alone with a ``--prompt_embeds`` file ([B, L, cap_feat_dim]) gives the
    library's latents for the same embeddings."""
    import jax

    from jaxdit.mesh import ParallelConfig
    from jaxdit.pipelines.z_image import ZImagePipeline

    embeds = np.random.default_rng(0).standard_normal((1, 7, 32)).astype(np.float32)
    np.savez(tmp_path / "emb.npz", prompt_embeds=embeds)
    argv = [
        "generate",
        "--weights",
        str(folder / "transformer"),
        "--prompt_embeds",
        str(tmp_path / "emb.npz"),
    ]
    argv += [
        "--height",
        "32",
        "--width",
        "48",
        "--steps",
        "2",
        "--guidance_scale",
        "0",
        "--ulysses_degree",
        "2",
    ]
    assert cli.main([*argv, "--output", str(tmp_path / "z.npy")]) == 0
    pipe = ZImagePipeline.from_checkpoint(
        folder / "transformer", ParallelConfig(ulysses=2).make_mesh(jax.devices()[:2])
    )
    want = pipe(
        prompt_embeds=list(embeds), height=32, width=48, num_inference_steps=2, guidance_scale=0.0,
        output_type="latent", progress=False,
    ).latents  # fmt: skip
    np.testing.assert_array_equal(np.load(tmp_path / "z.npy"), want)
