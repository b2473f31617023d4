"""FLUX.2's reference pictures for editing, sized as diffusers' ``Flux2KleinPipeline`` / ``Flux2Pipeline``
size them (``pipelines/flux2/pipeline_flux2*.py`` with ``Flux2ImageProcessor``).

Each picture must be at least 64 pixels a side and at most 8:1; one of more than 1024^2 pixels is first
resized (Lanczos) to about 1024^2 at its aspect ratio; then both sides are floored to a multiple of the
VAE factor x 2 by a centre crop (no resampling), and the pixels go to [-1, 1]. The first picture's size is
the output size of a call that gives none.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "MAX_AREA",
    "as_pictures",
    "check_picture",
    "picture_problem",
    "reference_pixels",
    "reference_size",
]

#: Pixels above which a reference picture is scaled down first (diffusers' 1024 x 1024).
MAX_AREA = 1024 * 1024
#: diffusers' ``Flux2ImageProcessor.check_image_input`` limits.
MIN_SIDE, MAX_ASPECT = 64, 8


def as_pictures(image: Any) -> list:
    """One picture or a list of them (PIL images, or [H, W, 3] uint8 / [0, 1] float arrays) -> RGB PIL
    images."""
    from PIL import Image

    items = list(image) if isinstance(image, list | tuple) else [image]
    if not items:
        raise ValueError("image is an empty list: give one or more reference pictures, or none")
    out = []
    for k, item in enumerate(items):
        if isinstance(item, Image.Image):
            out.append(item.convert("RGB"))
            continue
        array = np.asarray(item)
        if array.ndim == 4 and array.shape[0] == 1:
            array = array[0]
        if array.ndim != 3 or array.shape[-1] != 3:
            raise ValueError(f"image {k} must be a PIL image or an [H, W, 3] array, got shape {array.shape}")
        if array.dtype != np.uint8:
            array = np.round(np.clip(array.astype(np.float32), 0, 1) * 255).astype(np.uint8)
        out.append(Image.fromarray(array))
    return out


def picture_problem(width: int, height: int) -> str | None:
    """What diffusers' limits on a reference picture (each side >= 64 pixels, aspect ratio at most 8:1)
    say of a width x height one: its problem, else None."""
    if min(width, height) < MIN_SIDE:
        return f"both sides must be at least {MIN_SIDE} pixels"
    if max(width / height, height / width) > MAX_ASPECT:
        return f"aspect ratio above {MAX_ASPECT}:1"
    return None


def check_picture(width: int, height: int) -> None:
    """:func:`picture_problem`'s limits, raised as a ValueError naming the picture."""
    problem = picture_problem(width, height)
    if problem:
        raise ValueError(f"reference image {width}x{height}: {problem}")


def _scaled(width: int, height: int) -> tuple[int, int]:
    if width * height <= MAX_AREA:
        return width, height
    scale = math.sqrt(MAX_AREA / (width * height))
    return int(width * scale), int(height * scale)


def reference_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """(width, height) a width x height picture is joined at (after scaling down and cropping)."""
    check_picture(width, height)
    w, h = _scaled(width, height)
    return w // multiple * multiple, h // multiple * multiple


def reference_pixels(picture: Any, multiple: int) -> np.ndarray:
    """An RGB PIL picture -> [1, 3, H, W] fp32 in [-1, 1] at :func:`reference_size`."""
    from PIL import Image

    check_picture(*picture.size)
    w, h = _scaled(*picture.size)
    if (w, h) != picture.size:
        picture = picture.resize((w, h), Image.Resampling.LANCZOS)
    cw, ch = w // multiple * multiple, h // multiple * multiple
    left, top = (w - cw) // 2, (h - ch) // 2
    picture = picture.crop((left, top, left + cw, top + ch)).convert("RGB")
    pixels = np.asarray(picture, np.float32) / 255.0 * 2.0 - 1.0
    return pixels.transpose(2, 0, 1)[None]
