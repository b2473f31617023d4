"""Prompt -> pixels from a downloaded-layout folder, against diffusers running the same folder.

tests/tiny_pipelines.py writes random tiny diffusers ``FluxPipeline`` and ``WanPipeline`` folders with
``save_pretrained``. diffusers runs each folder in PyTorch; jaxdit runs the same folder on a mesh of
emulated devices, with the same prompt and the same initial noise (diffusers takes it as ``latents``).
Everything is fp32, so the only differences are float rounding in different operation orders (XLA vs
PyTorch kernels): ~1e-6 per op, carried through a few denoising steps, the VAE and the text encoders.
The bounds (tests/tolerance.py, PIXELS) are per pipeline, on pixels in [0, 1]: each pipeline's depth
(encoders, steps, VAE) sets its own rounding, measured in the bound's note.
"""

import numpy as np
import pytest
import tiny_pipelines
import tolerance as tol

from jaxdit import ParallelConfig
from jaxdit.pipelines import latents as latent_ops

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

FAST = {"xla_backend_optimization_level": 0}
PROMPT = "a small red cube"


def _flux_case():
    # 40 x 48 pixels -> 20 x 24 latent (VAE factor 2) -> 10 x 12 = 120 tokens; 20 latent rows over 8
    # devices in the VAE do not divide.
    return dict(height=40, width=48, num_inference_steps=3, guidance_scale=3.5)


def test_flux_folder_prompt_to_image_matches_diffusers():
    from jaxdit.pipelines.flux import FluxPipeline

    folder, ref_pipe = tiny_pipelines.flux()
    case = _flux_case()
    h, w = case["height"] // 2, case["width"] // 2
    noise = latent_ops.initial_noise(0, (1, 4, h, w))

    with torch.no_grad():
        ref = ref_pipe(
            PROMPT,
            negative_prompt="blurry",
            true_cfg_scale=2.0,
            latents=torch.from_numpy(latent_ops.pack(noise)),
            output_type="np",
            max_sequence_length=16,
            **case,
        ).images

    pipe = FluxPipeline.from_pretrained(
        folder, ParallelConfig(cfg=2, ring=2, ulysses=2), compiler_options=FAST
    )
    out = pipe(
        PROMPT,
        negative_prompt="blurry",
        true_cfg_scale=2.0,
        seed=0,
        progress=False,
        max_sequence_length=16,
        **case,
    )
    images = (out.images + 1) / 2
    assert images.shape == ref.shape == (1, 40, 48, 3)
    tol.check(images, ref, tol.PIXELS["flux"], "FLUX folder, cfg2 x ring2 x ulysses2 vs diffusers, pixels")


def test_wan_folder_prompt_to_video_matches_diffusers():
    from jaxdit.pipelines.wan import WanPipeline

    folder, ref_pipe = tiny_pipelines.wan()
    case = dict(height=48, width=64, num_frames=5, num_inference_steps=3, guidance_scale=5.0)
    noise = latent_ops.initial_noise(0, (1, 16, 2, 6, 8))

    with torch.no_grad():
        ref = ref_pipe(
            PROMPT,
            negative_prompt="static",
            latents=torch.from_numpy(noise),
            output_type="np",
            max_sequence_length=16,
            **case,
        ).frames

    pipe = WanPipeline.from_pretrained(folder, ParallelConfig(cfg=2, ulysses=2), compiler_options=FAST)
    out = pipe(PROMPT, negative_prompt="static", seed=0, progress=False, max_sequence_length=16, **case)
    video = (out.images + 1) / 2
    assert video.shape == ref.shape == (1, 5, 48, 64, 3)
    tol.check(video, ref, tol.PIXELS["wan"], "Wan folder, cfg2 x ulysses2 vs diffusers, pixels")


def test_wan_i2v_folder_image_to_video_matches_diffusers():
    from PIL import Image

    from jaxdit.pipelines.wan import WanPipeline

    folder, ref_pipe = tiny_pipelines.wan_i2v()
    case = dict(height=48, width=64, num_frames=5, num_inference_steps=2, guidance_scale=5.0)
    noise = latent_ops.initial_noise(1, (1, 16, 2, 6, 8))
    picture = np.random.default_rng(5).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    image = Image.fromarray(picture)

    with torch.no_grad():
        # diffusers' I2V transformer splits image tokens from text at L - 512: text must be 512 tokens.
        ref = ref_pipe(
            image=image,
            prompt=PROMPT,
            negative_prompt="static",
            latents=torch.from_numpy(noise),
            output_type="np",
            max_sequence_length=512,
            **case,
        ).frames

    pipe = WanPipeline.from_pretrained(folder, ParallelConfig(ring=2, ulysses=2), compiler_options=FAST)
    out = pipe(PROMPT, negative_prompt="static", image=image, seed=1, progress=False, **case)
    video = (out.images + 1) / 2
    assert video.shape == ref.shape == (1, 5, 48, 64, 3)
    tol.check(video, ref, tol.PIXELS["wan_i2v"], "Wan I2V folder, ring2 x ulysses2 vs diffusers, pixels")
