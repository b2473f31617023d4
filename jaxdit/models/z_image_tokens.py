"""Z-Image's token sequence, built on the host: patches, per-prompt caption lengths, pad tokens, RoPE ids.

As diffusers' ``ZImageTransformer2DModel.patchify_and_embed`` lays them out:

- an image (latent channels C, rows H, columns W) becomes (H/p)(W/p) tokens of p*p*C features in
  (row-in-patch, column-in-patch, channel) order, padded to a multiple of 32 with the learnt
  ``x_pad_token``;
- each caption keeps its own length L_i, padded to P_i = 32 * ceil(L_i / 32) with the learnt
  ``cap_pad_token``. Those pad tokens are attended like real ones (they are part of the model); only the
  batch padding beyond P_i (up to the longest prompt's P) is masked, as a key mask;
- RoPE ids (axis 0, row, column): caption token j at (1 + j, 0, 0), image token (r, c) at
  (P_i + 1, r, c), the image's pad tokens at (0, 0, 0). The image ids depend on the prompt's length, so
  they are per sample.

Inside the model the joint sequence is [image; caption] (token groups 0 and 1), so sample i attends
over its Npad image tokens and its P_i caption tokens, exactly as diffusers' per-sample concatenation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxdit.models.z_image_config import SEQ_MULTIPLE, ZImageConfig

__all__ = ["caption_inputs", "image_inputs", "pack", "padded", "sequence_inputs", "unpack"]


def padded(n: int) -> int:
    """``n`` tokens rounded up to the pad multiple."""
    return -(-n // SEQ_MULTIPLE) * SEQ_MULTIPLE


def pack(latents: np.ndarray, patch: int) -> np.ndarray:
    """[B, C, H, W] -> [B, (H/p)(W/p), p*p*C], features (row-in-patch, column-in-patch, channel)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.transpose(0, 2, 4, 3, 5, 1).reshape(b, (h // patch) * (w // patch), patch * patch * c)


def unpack(tokens, channels: int, height: int, width: int, patch: int):
    """The inverse of :func:`pack` on the first (H/p)(W/p) tokens (numpy or jax)."""
    b = tokens.shape[0]
    rows, cols = height // patch, width // patch
    x = tokens[:, : rows * cols].reshape(b, rows, cols, patch, patch, channels)
    return x.transpose(0, 5, 1, 3, 2, 4).reshape(b, channels, height, width)


def caption_inputs(feats: Sequence[np.ndarray]) -> dict[str, np.ndarray | None]:
    """One [L_i, D] array per prompt -> the caption group: features [B, T, D] (T = max P_i; zeros past
    L_i), ``cap_pad`` [B, T] (where the learnt pad token goes), ``cap_mask`` [B, T] (the P_i tokens a
    sample attends over; None when every prompt pads to the same P), ``cap_ids`` [B, T, 3]."""
    lengths = [int(f.shape[0]) for f in feats]
    if min(lengths) < 1:
        raise ValueError(f"a caption has no tokens (lengths {lengths})")
    dim = int(feats[0].shape[1])
    total = [padded(n) for n in lengths]
    t = max(total)
    out = np.zeros((len(feats), t, dim), np.float32)
    for i, f in enumerate(feats):
        out[i, : lengths[i]] = np.asarray(f, np.float32)
    j = np.arange(t)[None]
    cap_pad = (j >= np.asarray(lengths)[:, None]) & (j < np.asarray(total)[:, None])
    mask = j < np.asarray(total)[:, None]
    ids = np.zeros((len(feats), t, 3), np.int32)
    ids[..., 0] = np.where(mask, 1 + j, 0)
    return dict(
        cap_feats=out,
        cap_pad=cap_pad,
        cap_mask=None if len(set(total)) == 1 else mask,
        cap_ids=ids,
        cap_lengths=np.asarray(total, np.int32),
    )


def image_inputs(latents: np.ndarray, caption_lengths: np.ndarray, patch: int) -> dict[str, np.ndarray]:
    """[B, C, H, W] latents and each sample's padded caption length P_i -> the image group: ``hidden_states`` [B,
    Npad, p*p*C] (zeros past the image), ``x_pad`` [Npad] and ``img_ids`` [B, Npad, 3]."""
    b, _, h, w = latents.shape
    rows, cols = h // patch, w // patch
    n = rows * cols
    total = padded(n)
    tokens = pack(np.asarray(latents, np.float32), patch)
    x = np.zeros((b, total, tokens.shape[-1]), np.float32)
    x[:, :n] = tokens
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    ids = np.zeros((b, total, 3), np.int32)
    ids[:, :n, 0] = np.asarray(caption_lengths)[:, None] + 1
    ids[:, :n, 1] = r.reshape(-1)
    ids[:, :n, 2] = c.reshape(-1)
    return dict(hidden_states=x, x_pad=np.arange(total) >= n, img_ids=ids)


def sequence_inputs(latents: np.ndarray, feats: Sequence[np.ndarray], config: ZImageConfig) -> dict:
    """Latents [B, C, H, W] and one caption feature array per sample -> the model's inputs (no timestep)."""
    if latents.shape[0] != len(feats):
        raise ValueError(f"{latents.shape[0]} latents for {len(feats)} captions")
    p = config.patch_size
    if latents.shape[2] % p or latents.shape[3] % p:
        raise ValueError(f"latent size {latents.shape[2:]} is not a multiple of the patch size {p}")
    cap = caption_inputs(feats)
    img = image_inputs(latents, cap.pop("cap_lengths"), p)
    return {**img, **cap}
