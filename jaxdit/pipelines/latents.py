"""Latent tensors between the sampler and the transformer: 2x2 packing, positions, initial noise.

The 2x2 packing is shared by the families whose transformer takes packed latents (FLUX.1 and its
variants; Qwen-Image packs the same way): it packs a latent [B, C, H, W] into tokens [B, (H/2)(W/2), 4C] with channel index c*4 + ph*2 + pw
(latent channel slowest) and gives image token (i, j) the RoPE position (0, i, j); text tokens sit at
(0, 0, 0). The initial noise is drawn on the host from the seed alone, so the same seed gives the same
picture on every mesh.
"""

from __future__ import annotations

import numpy as np
from einops import rearrange


def pack(latents: np.ndarray) -> np.ndarray:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]."""
    h, w = latents.shape[2:]
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even to pack 2x2 patches, got {h}x{w}")
    return rearrange(latents, "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=2, pw=2)


def unpack(tokens: np.ndarray, height: int, width: int) -> np.ndarray:
    """Inverse of :func:`pack`: [B, (H/2)(W/2), 4C] -> [B, C, H, W] for a latent of height x width."""
    _, n, d = tokens.shape
    if n != (height // 2) * (width // 2) or d % 4:
        raise ValueError(f"{n} tokens of {d} features do not unpack to a {height}x{width} latent")
    return rearrange(tokens, "b (h w) (c ph pw) -> b c (h ph) (w pw)", h=height // 2, ph=2, pw=2)


def image_positions(height: int, width: int) -> np.ndarray:
    """RoPE ids of the packed image tokens of a height x width latent: [(H/2)(W/2), 3] = (0, row, col)."""
    rows, cols = np.meshgrid(np.arange(height // 2), np.arange(width // 2), indexing="ij")
    return np.stack([np.zeros_like(rows), rows, cols], axis=-1).reshape(-1, 3).astype(np.float32)


def text_positions(length: int) -> np.ndarray:
    return np.zeros((length, 3), np.float32)


def initial_noise(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal noise from the seed alone (host side, fp32): independent of the mesh."""
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
