"""A tiny random diffusers ``ZImageTransformer2DModel`` and inputs for it.

Four heads of 16 (so ulysses2 x tensor2 splits them), one refiner block per stream and two joint blocks,
RoPE axes (4, 6, 6); every weight perturbed away from its initial value (norm scales not all ones, the
pad tokens and zero-initialised layers non-zero).
"""

from __future__ import annotations

import numpy as np
import torch

CONFIG = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=4,
    dim=64,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=4,
    n_kv_heads=4,
    cap_feat_dim=24,
    axes_dims=[4, 6, 6],
    axes_lens=[160, 16, 16],
)


def transformer(seed: int = 0, scale: float = 0.1, **overrides) -> torch.nn.Module:
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(seed)
    model = ZImageTransformer2DModel(**{**CONFIG, **overrides})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


def inputs(lengths, rows: int, cols: int, seed: int = 0):
    """(latents [B, C, 2 rows, 2 cols], one [L_i, 24] caption array per sample, timesteps [B] in (0, 1))."""
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal((len(lengths), CONFIG["in_channels"], 2 * rows, 2 * cols)).astype(
        np.float32
    )
    caps = [rng.standard_normal((n, CONFIG["cap_feat_dim"])).astype(np.float32) for n in lengths]
    return latents, caps, rng.uniform(0.05, 1.0, len(lengths)).astype(np.float32)


def reference(model: torch.nn.Module, latents, caps, t) -> np.ndarray:
    """diffusers' prediction [B, C, H, W] (its own sign; the pipeline negates it)."""
    with torch.no_grad():
        out = model(
            [torch.from_numpy(x)[:, None] for x in latents],
            torch.from_numpy(t),
            [torch.from_numpy(c) for c in caps],
            return_dict=False,
        )[0]
    return np.stack([o[:, 0].numpy() for o in out])
