"""HunyuanVideo 1.5 image-to-video conditioning: the first frame's latents and its SigLIP tokens.

What diffusers' ``HunyuanVideo15ImageToVideoPipeline`` (``pipelines/hunyuan_video1_5/
pipeline_hunyuan_video1_5_image2video.py``) gives the transformer, computed here on the host (the picture
arithmetic, with PIL as diffusers and transformers use it) and with jaxdit's VAE and SigLIP encoder:

- the size: not a call argument but the picture's, snapped to the size bucket (about
  ``target_size``**2 pixels, 16-pixel steps, 1:4 to 4:1) whose aspect ratio is nearest from the wide side
  (:func:`jaxdit.pipelines.hunyuan_video15.default_size` with the picture's aspect);
- the picture scaled (Lanczos) to cover that size, aspect kept, and centre-cropped to it (diffusers'
  ``resize_mode="crop"``), then read in [-1, 1];
- ``condition`` [B, C + 1, F', h, w]: the VAE's posterior mean of that one frame times the VAE's
  ``scaling_factor`` in the first latent frame, zeros after it, then a mask channel that is 1 on the first
  latent frame and 0 elsewhere; it sits beside the noisy latents in the transformer's input channels;
- ``image_embeds`` [B, N, E]: the SigLIP vision model's last hidden state of the cropped picture after
  the folder's ``feature_extractor`` settings (resize to its size with its filter, rescale, normalise);
  every branch of CFG reads the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxdit.pipelines.wan_image import as_uint8_pictures

__all__ = ["FirstFrame", "SiglipProcessor", "crop_to", "first_frame_condition", "rgb_pictures"]


def rgb_pictures(image: Any) -> np.ndarray:
    """A PIL image (any mode: converted to RGB, as diffusers' ``do_convert_rgb``), a list of them, or RGB
    arrays [H, W, 3] / [B, H, W, 3] (uint8, or floats in [0, 1]) -> uint8 [B, H, W, 3]."""
    items = image if isinstance(image, list | tuple) else [image]
    if all(hasattr(p, "convert") for p in items):
        image = np.stack([np.asarray(p.convert("RGB")) for p in items])
    return as_uint8_pictures(image)


def crop_to(picture: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3] -> [height, width, 3]: scaled (Lanczos) so that it covers the size with its aspect
    kept, then centred on it with the excess cut (diffusers' ``_resize_and_crop``, sizes floored as
    there)."""
    from PIL import Image

    src_h, src_w = picture.shape[:2]
    if width / height > src_w / src_h:  # the picture is narrower: match the width
        new_w, new_h = width, src_h * width // src_w
    else:
        new_w, new_h = src_w * height // src_h, height
    scaled = Image.fromarray(picture).resize((new_w, new_h), resample=Image.LANCZOS)
    canvas = Image.new("RGB", (width, height))
    canvas.paste(scaled, box=(width // 2 - new_w // 2, height // 2 - new_h // 2))
    return np.asarray(canvas)


class SiglipProcessor:
    """A folder's ``feature_extractor/preprocessor_config.json`` (transformers' ``SiglipImageProcessor``
    settings) applied to uint8 pictures: resize to its size with its PIL filter, rescale, normalise;
    returns ``pixel_values`` [B, 3, S, S] float32."""

    def __init__(self, config: dict[str, Any]) -> None:
        size = config.get("size", {"height": 224, "width": 224})
        if set(size) != {"height", "width"}:
            raise ValueError(f"feature_extractor size {size}: only a fixed height and width is supported")
        if config.get("do_center_crop") or config.get("do_pad"):
            raise ValueError("feature_extractor: center crop and padding are not SigLIP's; not supported")
        self.size = (int(size["height"]), int(size["width"]))
        self.do_resize = bool(config.get("do_resize", True))
        self.resample = int(config.get("resample", 3))  # PIL's BICUBIC
        self.rescale = float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else 1.0
        normalize = config.get("do_normalize", True)
        self.mean = np.asarray(config.get("image_mean", [0.5] * 3) if normalize else [0.0] * 3, np.float32)
        self.std = np.asarray(config.get("image_std", [0.5] * 3) if normalize else [1.0] * 3, np.float32)

    @classmethod
    def from_folder(cls, folder: Path) -> SiglipProcessor:
        path = folder / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(f"{folder}: no preprocessor_config.json (the SigLIP image processor's settings)")
        return cls(json.loads(path.read_text(encoding="utf-8")))

    def __call__(self, pictures: np.ndarray) -> np.ndarray:
        from PIL import Image

        out = []
        for p in pictures:
            if self.do_resize and p.shape[:2] != self.size:
                image = Image.fromarray(p).resize(self.size[::-1], resample=self.resample)
                p = np.asarray(image)
            x = p.astype(np.float64) * self.rescale  # as transformers: rescale in float64, then normalise
            out.append(((x - self.mean) / self.std).astype(np.float32).transpose(2, 0, 1))
        return np.stack(out)


def first_frame_condition(latent: np.ndarray, frames: int) -> np.ndarray:
    """[B, C, 1, h, w] scaled first-frame latent -> [B, C + 1, frames, h, w]: it in the first latent
    frame and zeros after, then the mask channel (1 on the first latent frame)."""
    b, c, _, h, w = latent.shape
    out = np.zeros((b, c + 1, frames, h, w), np.float32)
    out[:, :c, 0] = latent[:, :, 0]
    out[:, c, 0] = 1.0
    return out


class FirstFrame:
    """``(pictures, num_frames, height, width) -> (image_embeds, condition)`` for the I2V pipeline.

    ``encode_pixels``: [B, 3, 1, H, W] in [-1, 1] -> the VAE's posterior mean [B, C, 1, h, w] (unscaled);
    ``image_encoder``: ``pixel_values`` -> SigLIP's last hidden state; ``processor``: :class:`SiglipProcessor`.
    """

    def __init__(
        self,
        encode_pixels: Callable[[np.ndarray], np.ndarray],
        image_encoder: Callable[[np.ndarray], np.ndarray],
        processor: SiglipProcessor,
        scaling_factor: float,
        temporal: int = 4,
    ) -> None:
        self.encode_pixels, self.image_encoder, self.processor = encode_pixels, image_encoder, processor
        self.scaling_factor, self.temporal = scaling_factor, temporal

    def __call__(
        self, pictures: Any, num_frames: int, height: int, width: int
    ) -> tuple[np.ndarray, np.ndarray]:
        cropped = np.stack([crop_to(p, height, width) for p in rgb_pictures(pictures)])
        embeds = np.asarray(self.image_encoder(self.processor(cropped)), np.float32)
        pixels = (cropped.astype(np.float32) / 255.0 * 2.0 - 1.0).transpose(0, 3, 1, 2)[:, :, None]
        latent = np.asarray(self.encode_pixels(pixels), np.float32) * self.scaling_factor
        return embeds, first_frame_condition(latent, (num_frames - 1) // self.temporal + 1)
