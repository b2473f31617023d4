"""A tiny random diffusers ``HunyuanVideo15Transformer3DModel`` and inputs for it.

Four heads of 16 (so ulysses2 x tensor2 splits them), two dual-stream blocks and two refiner blocks,
RoPE axes (4, 6, 6), 2 x 2 spatial patches; every weight perturbed away from its initial value (norm
scales not all ones, biases not zero, zero-initialised layers non-zero).
"""

from __future__ import annotations

import numpy as np
import torch

CONFIG = dict(
    in_channels=5,
    out_channels=2,
    num_attention_heads=4,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=2,
    patch_size=2,
    patch_size_t=1,
    text_embed_dim=24,
    text_embed_2_dim=20,
    image_embed_dim=12,
    rope_axes_dim=(4, 6, 6),
)


def transformer(seed: int = 0, scale: float = 0.1, **overrides) -> torch.nn.Module:
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    model = HunyuanVideo15Transformer3DModel(**{**CONFIG, **overrides})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


def inputs(frames, height, width, lengths, glyph_lengths, text=5, glyph=3, image=0, seed=0):
    """diffusers' forward arguments: latents [B, 5, frames, height, width], prompt features [B, text, 24]
    with ``lengths`` real tokens each, glyph features [B, glyph, 20] with ``glyph_lengths`` real tokens
    (zero features beyond, as the pipeline pads them), image tokens [B, image or 4, 12] (zeros unless
    ``image``), timesteps in [0, 1000]."""
    rng = np.random.default_rng(seed)
    b = len(lengths)

    def masked(n, dim, counts):
        mask = (np.arange(n)[None] < np.asarray(counts)[:, None]).astype(np.int64)
        return (rng.standard_normal((b, n, dim)) * mask[..., None]).astype(np.float32), mask

    txt, mask = masked(text, CONFIG["text_embed_dim"], lengths)
    g, gmask = masked(glyph, CONFIG["text_embed_2_dim"], glyph_lengths)
    img = rng.standard_normal((b, image or 4, CONFIG["image_embed_dim"])).astype(np.float32)
    shape = (b, CONFIG["in_channels"], frames, height, width)
    return dict(
        hidden_states=rng.standard_normal(shape).astype(np.float32),
        encoder_hidden_states=txt,
        encoder_attention_mask=mask,
        encoder_hidden_states_2=g,
        encoder_attention_mask_2=gmask,
        image_embeds=img if image else np.zeros_like(img),
        timestep=rng.uniform(50.0, 1000.0, b).astype(np.float32),
    )


def reference(model: torch.nn.Module, x: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in x.items()}, return_dict=False)[0]
    return out.numpy()
