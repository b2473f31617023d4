"""Qwen-Image end to end: a tiny diffusers ``QwenImagePipeline`` folder (random weights, saved with
``save_pretrained``) from a prompt and a negative prompt of another length, with true CFG 4.0, to a PNG
through ``jaxdit generate`` on 4 emulated devices, against diffusers running the reloaded folder with the
same initial noise; and the bad inputs refused before any weight loads.

The folder: the tiny transformer of ``qwen_image_tiny.py`` with the tiny Qwen2.5-VL's text width (32),
a 2-level ``AutoencoderKLQwenImage`` (factor 2, 4 latent channels, its own latents mean/std), the
word-level tokenizer whose template prefix is 34 tokens (``decoder_lm_tiny.py``), Qwen-Image's scheduler
config (dynamic shift 0.5..0.9 over 256..8192 tokens, terminal 0.02). A 32 x 40 picture: a 16 x 20 latent,
8 x 10 = 80 packed tokens; prompts of 10 and 7 real tokens. Bounds: the project's (final latents 1e-4
relative, PNG 1.5/255), errors printed (``pytest -s``).
"""

from __future__ import annotations

import decoder_lm_tiny
import numpy as np
import pytest
import qwen_image_tiny
from PIL import Image

from jaxdit import cli
from jaxdit.pipelines import latents as latent_ops

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

PROMPT = "a red car at sunset"
NEGATIVE = "a big dog"
H, W, STEPS, SEED, CFG = 32, 40, 3, 5, 4.0
LATENT_REL, PNG_STEPS = 1e-4, 1.5
SCHEDULER = dict(
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)


def _vae():
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 1],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[0.3, -0.2, 0.1, -0.4],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith(("gamma", "bias")):
                p.add_(0.1 * torch.randn_like(p))
    return vae.eval()


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, diffusers' final latents [1, 4, h, w], diffusers' pixels [H, W, 3] in [0, 1])."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("qwen_image")
    parts = root / "parts"
    decoder_lm_tiny.save_qwen_tokenizer(parts / "tokenizer")
    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=_vae(),
        text_encoder=decoder_lm_tiny.qwen2_5_vl(),
        tokenizer=AutoTokenizer.from_pretrained(parts / "tokenizer"),
        transformer=qwen_image_tiny.transformer(joint_attention_dim=decoder_lm_tiny.TEXT["hidden_size"]),
    )
    folder = root / "Qwen-Image-tiny"
    pipe.save_pretrained(folder)
    ref = diffusers.QwenImagePipeline.from_pretrained(folder)
    noise = latent_ops.initial_noise(SEED, (1, 4, H // 2, W // 2))
    call = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        true_cfg_scale=CFG,
        height=H,
        width=W,
        num_inference_steps=STEPS,
    )
    with torch.no_grad():
        packed = ref(**call, latents=torch.from_numpy(latent_ops.pack(noise)), output_type="latent").images
        pixels = ref(**call, latents=torch.from_numpy(latent_ops.pack(noise)), output_type="np").images
    return str(folder), latent_ops.unpack(packed.numpy(), H // 2, W // 2), pixels[0]


def _argv(folder, *mesh):
    argv = ["generate", "--weights", folder, "--prompt", PROMPT, "--negative_prompt", NEGATIVE]
    argv += ["--true_cfg_scale", str(CFG), "--height", str(H), "--width", str(W), "--steps", str(STEPS)]
    return argv + ["--seed", str(SEED), *mesh]


def _check_against_diffusers(case, tmp_path, mesh):
    folder, want_latents, want_pixels = case
    assert cli.main([*_argv(folder, *mesh), "--output", str(tmp_path / "z.npy")]) == 0
    assert cli.main([*_argv(folder, *mesh), "--output", str(tmp_path / "picture.png")]) == 0
    latents = np.load(tmp_path / "z.npy")
    png = np.asarray(Image.open(tmp_path / "picture.png"), np.float32)
    assert latents.shape == want_latents.shape == (1, 4, H // 2, W // 2)
    rel = np.linalg.norm(latents - want_latents) / np.linalg.norm(want_latents)
    worst = np.abs(png - want_pixels * 255).max()
    print(f"{' '.join(mesh)}: latents {rel:.2e} relative, PNG {worst:.2f}/255")
    assert rel < LATENT_REL, rel
    assert png.shape == (H, W, 3) and worst <= PNG_STEPS, worst


def test_cli_cfg2_ulysses2_matches_diffusers(case, tmp_path):
    _check_against_diffusers(case, tmp_path, ["--use_cfg_parallel", "--ulysses_degree", "2"])


def test_cli_ulysses2_ring2_matches_diffusers(case, tmp_path):
    _check_against_diffusers(case, tmp_path, ["--ulysses_degree", "2", "--ring_degree", "2"])


def test_cli_pipefusion2_ulysses2_matches_diffusers(case, tmp_path):
    """Every step a warm-up step: PipeFusion's synchronous steps are the serial forward; the text mask of
    both prompts reaches its patch attention."""
    mesh = ["--pipefusion_parallel_degree", "2", "--ulysses_degree", "2", "--warmup_steps", str(STEPS)]
    _check_against_diffusers(case, tmp_path, mesh)
