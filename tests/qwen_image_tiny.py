"""A tiny random diffusers ``QwenImageTransformer2DModel`` and inputs for it.

Four heads of 16 (so ulysses2 x tensor2 splits them), two blocks, RoPE axes (4, 6, 6); every weight
perturbed away from its initial value (norm scales not all ones, biases not zero, the zero-initialised
output layers non-zero).
"""

from __future__ import annotations

import numpy as np
import torch

CONFIG = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=24,
    axes_dims_rope=(4, 6, 6),
)


def transformer(seed: int = 0, scale: float = 0.1, **overrides) -> torch.nn.Module:
    """``CONFIG`` with ``overrides`` (e.g. the text width of a tiny encoder)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**{**CONFIG, **overrides})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


def inputs(batch: int, text: int, rows: int, cols: int, lengths, seed: int = 0) -> dict[str, np.ndarray]:
    """Packed latents [B, rows*cols, 16], text features [B, text, 24] with a mask of ``lengths`` real
    tokens per prompt (zero features beyond, as diffusers' pipeline pads them), sigmas [B]."""
    rng = np.random.default_rng(seed)
    mask = (np.arange(text)[None] < np.asarray(lengths)[:, None]).astype(np.int64)
    txt = (
        rng.standard_normal((batch, text, CONFIG["joint_attention_dim"])).astype(np.float32) * mask[..., None]
    )
    return dict(
        hidden_states=rng.standard_normal((batch, rows * cols, CONFIG["in_channels"])).astype(np.float32),
        encoder_hidden_states=txt.astype(np.float32),
        encoder_hidden_states_mask=mask,
        timestep=rng.uniform(0.05, 1.0, batch).astype(np.float32),
    )


def reference(model: torch.nn.Module, x: dict[str, np.ndarray], rows: int, cols: int) -> np.ndarray:
    with torch.no_grad():
        out = model(
            hidden_states=torch.from_numpy(x["hidden_states"]),
            encoder_hidden_states=torch.from_numpy(x["encoder_hidden_states"]),
            encoder_hidden_states_mask=torch.from_numpy(x["encoder_hidden_states_mask"]),
            timestep=torch.from_numpy(x["timestep"]),
            img_shapes=[(1, rows, cols)] * len(x["timestep"]),
            return_dict=False,
        )[0]
    return out.numpy()
