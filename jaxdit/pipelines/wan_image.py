"""Wan 2.1 image-to-video conditioning: CLIP image features and the first-frame condition latent.

What diffusers' ``WanImageToVideoPipeline`` feeds the transformer beside the noise (``encode_image`` and
``prepare_latents`` in diffusers 0.42.1), computed here with jaxdit's CLIP vision encoder and Wan VAE:

- ``image_embeds``: the CLIP vision model's penultimate hidden states of the input picture [B, 257, 1280].
- ``condition`` [B, 4 + 16, F', h, w]: 4 mask channels (1 where the frame is given: the first video frame,
  repeated over the VAE's 4-frame temporal stride, so the first latent frame's 4 mask channels are 1 and
  the rest 0), then the VAE latent (posterior mean, normalised by the VAE's latents_mean / latents_std)
  of a video whose first frame is the picture and whose other frames are zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ImageCondition", "as_uint8_pictures", "first_frame_mask", "to_vae_pixels"]


def as_uint8_pictures(image: Any) -> np.ndarray:
    """Picture(s) -> uint8 [B, H, W, 3]: what both encoders start from (CLIP's processor rescales by 1/255,
    so a float picture handed to it as is would be read 255 times too dark)."""
    arrays = np.asarray(image)
    if arrays.ndim == 3:
        arrays = arrays[None]
    if arrays.ndim != 4 or arrays.shape[-1] != 3:
        raise ValueError(f"expected RGB picture(s) [H, W, 3] or [B, H, W, 3], got shape {arrays.shape}")
    if arrays.dtype != np.uint8:
        if arrays.min() < 0 or arrays.max() > 1:
            raise ValueError("float pictures must lie in [0, 1] (or pass uint8)")
        arrays = np.round(arrays * 255).astype(np.uint8)
    return arrays


def to_vae_pixels(image: Any, height: int, width: int) -> np.ndarray:
    """Picture(s) -> [B, 3, H, W] float32 in [-1, 1], resized (Lanczos, as diffusers) when the size differs.

    ``image``: a PIL image, a uint8 array [H, W, 3] or [B, H, W, 3], or a float array in [0, 1].
    """
    from PIL import Image

    out = []
    arrays = as_uint8_pictures(image)
    for a in arrays:
        if a.shape[:2] != (height, width):
            a = np.asarray(Image.fromarray(a).resize((width, height), Image.LANCZOS))
        out.append(a)
    pixels = np.stack(out).astype(np.float32) / 255.0 * 2.0 - 1.0
    return pixels.transpose(0, 3, 1, 2)


def first_frame_mask(batch: int, num_frames: int, height: int, width: int, temporal: int) -> np.ndarray:
    """[B, temporal, F', h, w]: 1 on the given (first) frame, which fills the first latent frame's slots."""
    frames = np.zeros((batch, num_frames + temporal - 1, height, width), np.float32)
    frames[:, :temporal] = 1.0  # the first frame repeated over the first latent frame's temporal slots
    latent_frames = (num_frames - 1) // temporal + 1
    return frames.reshape(batch, latent_frames, temporal, height, width).transpose(0, 2, 1, 3, 4)


class ImageCondition:
    """``encode_image(images, num_frames, height, width) -> (image_embeds, condition)`` for WanPipeline.

    ``mesh``: the VAE encode of the whole video (the memory peak of image-to-video) is row-parallel over
    all its devices (``WanVAE.encode(x, mesh)``); None: one device.
    """

    def __init__(
        self, image_encoder: Any, vae: Any, temporal: int = 4, spatial: int = 8, mesh: Any = None
    ) -> None:
        self.image_encoder, self.vae = image_encoder, vae
        self.temporal, self.spatial = temporal, spatial
        self.mesh = mesh

    def __call__(
        self, images: Any, num_frames: int, height: int, width: int
    ) -> tuple[np.ndarray, np.ndarray]:
        batched = as_uint8_pictures(images)
        embeds = np.asarray(self.image_encoder(list(batched)), np.float32)
        pixels = to_vae_pixels(batched, height, width)
        b = pixels.shape[0]
        video = np.zeros((b, 3, num_frames, height, width), np.float32)
        video[:, :, 0] = pixels
        mean, _ = self.vae.encode(video, mesh=self.mesh)
        config = self.vae.config
        shape = (1, -1, 1, 1, 1)
        latents_mean = np.asarray(config.latents_mean, np.float32).reshape(shape)
        latents_std = np.asarray(config.latents_std, np.float32).reshape(shape)
        latent = (np.asarray(mean, np.float32) - latents_mean) / latents_std
        h, w = height // self.spatial, width // self.spatial
        mask = first_frame_mask(b, num_frames, h, w, self.temporal)
        return embeds, np.concatenate([mask, latent], axis=1)
