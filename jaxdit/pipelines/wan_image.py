"""Wan image-to-video conditioning: CLIP image features and the first-frame condition latent.

What diffusers' ``WanImageToVideoPipeline`` feeds the transformer (``encode_image`` and ``prepare_latents``
in diffusers 0.42.1), computed here with jaxdit's CLIP vision encoder and Wan VAE:

- ``image_embeds`` (Wan 2.1 I2V only; Wan 2.2 I2V-A14B has no CLIP image path): the CLIP vision model's
  penultimate hidden states of the input picture [B, 257, 1280].
- ``condition`` [B, 4 + 16, F', h, w] (Wan 2.1 I2V, Wan 2.2 I2V-A14B; :class:`ImageCondition`): 4 mask
  channels (1 where the frame is given: the first video frame, repeated over the VAE's 4-frame temporal
  stride, so the first latent frame's 4 mask channels are 1 and the rest 0), then the VAE latent
  (posterior mean, normalised by the VAE's latents_mean / latents_std) of a video whose first frame is
  the picture and whose other frames are zero.
- Wan 2.2 TI2V (``expand_timesteps``; :class:`FirstFrameLatent`): ``condition`` [B, C, 1, h, w] is the
  normalised latent of the picture alone (one frame through the Wan 2.2 VAE), which the pipeline puts in
  place of the first latent frame at every step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["FirstFrameLatent", "ImageCondition", "as_uint8_pictures", "first_frame_mask", "to_vae_pixels"]


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


def _normalized_mean(vae: Any, video: np.ndarray, mesh: Any) -> np.ndarray:
    """The VAE's posterior mean of ``video``, normalised by its latents_mean / latents_std (fp32)."""
    mean, _ = vae.encode(video, mesh=mesh)
    config = vae.config
    shape = (1, -1, 1, 1, 1)
    latents_mean = np.asarray(config.latents_mean, np.float32).reshape(shape)
    latents_std = np.asarray(config.latents_std, np.float32).reshape(shape)
    return (np.asarray(mean, np.float32) - latents_mean) / latents_std


class ImageCondition:
    """``encode_image(images, num_frames, height, width) -> (image_embeds, condition)`` for WanPipeline.

    ``image_encoder``: Wan 2.1's CLIP vision encoder, or None (Wan 2.2 I2V-A14B: ``image_embeds`` is None).
    ``temporal`` / ``spatial``: the VAE's compression (the Wan 2.1 VAE's 4 and 8, which A14B uses too).
    ``mesh``: the VAE encode of the
    whole video (the memory peak of image-to-video) is row-parallel over all its devices
    (``WanVAE.encode(x, mesh)``); None: one device.
    """

    def __init__(
        self,
        image_encoder: Any,
        vae: Any,
        temporal: int = 4,
        spatial: int = 8,
        mesh: Any = None,
    ) -> None:
        self.image_encoder, self.vae = image_encoder, vae
        self.temporal, self.spatial = temporal, spatial
        self.mesh = mesh

    def __call__(
        self, images: Any, num_frames: int, height: int, width: int
    ) -> tuple[np.ndarray | None, np.ndarray]:
        batched = as_uint8_pictures(images)
        embeds = None
        if self.image_encoder is not None:
            embeds = np.asarray(self.image_encoder(list(batched)), np.float32)
        pixels = to_vae_pixels(batched, height, width)
        b = pixels.shape[0]
        video = np.zeros((b, 3, num_frames, height, width), np.float32)
        video[:, :, 0] = pixels
        latent = _normalized_mean(self.vae, video, self.mesh)
        h, w = height // self.spatial, width // self.spatial
        mask = first_frame_mask(b, num_frames, h, w, self.temporal)
        return embeds, np.concatenate([mask, latent], axis=1)


class FirstFrameLatent:
    """TI2V's ``encode_image(images, num_frames, height, width) -> (None, condition)``: the picture alone
    through the VAE (one frame, row-parallel over ``mesh``), normalised: [B, C, 1, h, w]."""

    def __init__(self, vae: Any, mesh: Any = None) -> None:
        self.vae, self.mesh = vae, mesh

    def __call__(self, images: Any, num_frames: int, height: int, width: int) -> tuple[None, np.ndarray]:
        pixels = to_vae_pixels(as_uint8_pictures(images), height, width)
        return None, _normalized_mean(self.vae, pixels[:, :, None], self.mesh)
