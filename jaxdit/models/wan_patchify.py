"""Wan's global-view token helpers: latent <-> patch tokens, the token grid and each token's position.

Used outside ``shard_map`` (pure reshapes, numpy or jax): the pipeline patchifies the latent once on the
host, the model reads (frame, row, col) positions for its 3D RoPE. The patch embedding of
``wan/modules/model.py`` (Wan-Video/Wan2.1) is a Conv3d with kernel = stride = patch, i.e. one linear
map per patch, so a token's features are that patch flattened in the Conv3d weight's (c, t, h, w)
order; the head writes (t, h, w, c), which ``swap_features`` converts between.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from einops import rearrange

__all__ = ["latent_grid", "patchify", "swap_features", "token_positions", "unpatchify"]


def latent_grid(shape: Sequence[int], patch_size: Sequence[int]) -> tuple[int, int, int]:
    """(F', H', W') token grid of a [B, C, F, H, W] latent; the sizes must be multiples of the patch."""
    f, h, w = (int(s) for s in shape[-3:])
    pt, ph, pw = patch_size
    if f % pt or h % ph or w % pw:
        raise ValueError(
            f"latent frames x height x width {f}x{h}x{w} are not multiples of the patch {pt}x{ph}x{pw}"
        )
    return f // pt, h // ph, w // pw


def patchify(video: jax.Array, patch_size: Sequence[int]) -> jax.Array:
    """[B, C, F, H, W] -> [B, N, C*pt*ph*pw] tokens in (frame, row, col) order.

    The patch embedding is a Conv3d with kernel = stride = patch, i.e. one linear map per patch; the
    feature order (c, t, h, w) matches the Conv3d weight flattened as [E, C*pt*ph*pw].
    """
    latent_grid(video.shape, patch_size)  # the sizes must be multiples of the patch
    pt, ph, pw = patch_size
    return rearrange(video, "b c (f pt) (h ph) (w pw) -> b (f h w) (c pt ph pw)", pt=pt, ph=ph, pw=pw)


def unpatchify(tokens: jax.Array, grid: Sequence[int], patch_size: Sequence[int], channels: int) -> jax.Array:
    """[B, N, pt*ph*pw*C] -> [B, C, F, H, W]; the output channel is the fastest feature (unlike FLUX)."""
    (f, h, w), (pt, ph, pw) = grid, patch_size
    pattern = "b (f h w) (pt ph pw c) -> b c (f pt) (h ph) (w pw)"
    return rearrange(tokens, pattern, f=f, h=h, w=w, pt=pt, ph=ph, pw=pw, c=channels)


def swap_features(tokens: Any, outer: int, inner: int) -> Any:
    """[..., outer * inner] -> [..., inner * outer]: swap the two factors of each token's feature index.

    (patch, channel) -> (channel, patch) turns the head's (t, h, w, c) features into the patch embedding's
    (c, t, h, w) order, and back. numpy or jax; only each token's own features move.
    """
    return rearrange(tokens, "... (outer inner) -> ... (inner outer)", outer=outer, inner=inner)


def token_positions(grid: Sequence[int]) -> np.ndarray:
    """[N, 3] int32 (frame, row, col) of every token, in patchify order (static: computed with numpy)."""
    f, h, w = grid
    pos = np.stack(np.meshgrid(np.arange(f), np.arange(h), np.arange(w), indexing="ij"), axis=-1)
    return pos.reshape(-1, 3).astype(np.int32)
