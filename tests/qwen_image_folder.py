"""A tiny random diffusers ``QwenImagePipeline`` folder (saved with ``save_pretrained``) and diffusers'
run of it, shared by the Qwen-Image pipeline tests.

The folder: the tiny transformer of ``qwen_image_tiny.py`` with the tiny Qwen2.5-VL's text width (32), a
2-level ``AutoencoderKLQwenImage`` (factor 2, 4 latent channels, its own latents mean/std), the word-level
tokenizer whose template prefix is 34 tokens (``decoder_lm_tiny.py``) and Qwen-Image's scheduler config
(dynamic shift 0.5..0.9 over 256..8192 tokens, terminal 0.02).
"""

from __future__ import annotations

from pathlib import Path

import decoder_lm_tiny
import numpy as np
import qwen_image_tiny
import torch

from jaxdit.pipelines import latents as latent_ops

PROMPT = "a red car at sunset"
NEGATIVE = "a big dog"
H, W, STEPS, SEED, CFG = 32, 40, 3, 5, 4.0
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


def vae():
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


def save(root: Path) -> Path:
    """The tiny pipeline saved in ``root``; returns its folder."""
    import diffusers
    from transformers import AutoTokenizer

    decoder_lm_tiny.save_qwen_tokenizer(root / "parts" / "tokenizer")
    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae(),
        text_encoder=decoder_lm_tiny.qwen2_5_vl(),
        tokenizer=AutoTokenizer.from_pretrained(root / "parts" / "tokenizer"),
        transformer=qwen_image_tiny.transformer(joint_attention_dim=decoder_lm_tiny.TEXT["hidden_size"]),
    )
    folder = root / "Qwen-Image-tiny"
    pipe.save_pretrained(folder)
    return folder


def noise() -> np.ndarray:
    """The project's initial noise: the seed's standard normal in the latent grid [1, 4, H/2, W/2]."""
    return latent_ops.initial_noise(SEED, (1, 4, H // 2, W // 2))


def reference(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """diffusers on the reloaded folder, from the prompt and the negative prompt with true CFG, from
    :func:`noise` packed: (final latents [1, 4, h, w], pixels [H, W, 3] in [0, 1])."""
    import diffusers

    ref = diffusers.QwenImagePipeline.from_pretrained(folder)
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=CFG, height=H, width=W)
    packed = torch.from_numpy(latent_ops.pack(noise()))
    with torch.no_grad():
        latents = ref(**call, num_inference_steps=STEPS, latents=packed, output_type="latent").images
        pixels = ref(**call, num_inference_steps=STEPS, latents=packed, output_type="np").images
    return latent_ops.unpack(latents.numpy(), H // 2, W // 2), pixels[0]
