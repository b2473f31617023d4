"""A tiny random diffusers ``HunyuanVideo15Pipeline`` folder (transformer, VAE, scheduler, guider; no text
encoders: calls take embeddings) and embeddings for it."""

from __future__ import annotations

from pathlib import Path

import hunyuan_video15_tiny as tiny
import numpy as np
import torch

#: 4 latent channels (the transformer takes 4 + 4 + 1), the real 16x / 4x compression, widths 8-16.
VAE = dict(latent_channels=4, block_out_channels=(8, 8, 16, 16, 16), layers_per_block=1)
TRANSFORMER = dict(in_channels=9, out_channels=4, patch_size=1, target_size=64)
SHIFT, GUIDANCE = 5.0, 6.0


def pipeline():
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
    )

    transformer = tiny.transformer(**TRANSFORMER)
    torch.manual_seed(1)
    vae = AutoencoderKLHunyuanVideo15(**VAE).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return HunyuanVideo15Pipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        text_encoder_2=None,
        tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE),
    )


def save(folder: Path):
    pipe = pipeline()
    pipe.save_pretrained(folder)
    return pipe


def embeddings(lengths, glyph_lengths, text=6, glyph=4, seed=0, prefix=""):
    """One branch's embeddings as the pipeline's call takes them (zero features past each mask)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, n, dim, counts in (
        ("prompt_embeds", text, tiny.CONFIG["text_embed_dim"], lengths),
        ("prompt_embeds_2", glyph, tiny.CONFIG["text_embed_2_dim"], glyph_lengths),
    ):
        mask = (np.arange(n)[None] < np.asarray(counts)[:, None]).astype(np.int64)
        x = (rng.standard_normal((len(counts), n, dim)) * mask[..., None]).astype(np.float32)
        mask_name = name.replace("prompt_embeds", "prompt_embeds_mask")
        out[prefix + name], out[prefix + mask_name] = x, mask
    return out
