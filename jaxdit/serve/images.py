"""Input pictures in a request body: base64 text -> checked, decoded pictures, or a :class:`RequestError`
naming the picture and its problem.

A model that takes pictures (the family says so: ``ModelFamily.image_count``; Qwen-Image-Edit, FLUX.2,
FLUX.1 Kontext) is sent them as the ``image`` field, one base64 string or a list of them, each the bytes of
a PNG, JPEG or WebP file (a ``data:image/...;base64,`` prefix is taken too). Every check runs in the HTTP
handler, before anything is queued: strict base64, a known format, a picture no larger than the server's
pixel limit (read from the header before the pixels are decoded), the whole file decoded (a truncated one
fails here, not on the devices), and a mode that converts to RGB as ``jaxdit generate --image`` reads it.
The body's byte limit is the application's (``jaxdit serve --max_body_bytes``).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

import numpy as np

from jaxdit.serve.errors import RequestError

__all__ = ["FORMATS", "MODES", "decode", "decode_all", "encode_png"]

#: The file formats taken (Pillow's names).
FORMATS = ("PNG", "JPEG", "WEBP")
#: The modes taken: 8-bit pictures that convert to RGB as ``jaxdit generate`` reads them (alpha dropped;
#: CMYK: Pillow's JPEGs from print workflows). 16-bit and float modes are refused, not silently clipped.
MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK")
_DATA_URL = re.compile(r"^data:image/[a-z0-9.+-]+;base64,", re.IGNORECASE)


def decode(text: Any, name: str, max_pixels: int) -> tuple[str, np.ndarray]:
    """One picture's base64 text -> (the text without a data-URL prefix, RGB pixels [H, W, 3] uint8)."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(text, str):
        raise RequestError(f"{name} must be a base64 string, got {type(text).__name__}", "image")
    text = _DATA_URL.sub("", text.strip(), count=1)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"{name} is not valid base64 ({e})", "image") from None
    if not data:
        raise RequestError(f"{name} is empty", "image")
    try:
        picture = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise RequestError(f"{name} is not a PNG, JPEG or WebP picture", "image") from None
    except Image.DecompressionBombError as e:  # Pillow's own bound, far above any server's
        raise RequestError(f"{name} is too large a picture ({e})", "image") from None
    width, height = picture.size
    if width * height > max_pixels:  # from the header, before the pixels are decoded
        raise RequestError(
            f"{name} is {width}x{height} = {width * height} pixels; this server takes at most {max_pixels}",
            "image",
        )
    if picture.mode not in MODES:
        raise RequestError(
            f"{name} has mode {picture.mode}; send an 8-bit RGB, RGBA, CMYK, grayscale or palette picture",
            "image",
        )
    try:
        picture.load()
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        raise RequestError(f"{name} ({picture.format}) cannot be decoded: {e}", "image") from None
    return text, np.asarray(picture.convert("RGB"))


def decode_all(value: Any, least: int, most: int, max_pixels: int) -> list[tuple[str, np.ndarray]]:
    """The ``image`` field (one string or a list of ``least``..``most``) -> each picture's
    (base64 text, pixels), checked in order (the first problem is the one named)."""
    items = value if isinstance(value, list) else [value]
    if not least <= len(items) <= most:
        counts = f"{least}" if least == most else f"{least} to {most}"
        raise RequestError(f"image: this model takes {counts} pictures, got {len(items)}", "image")
    many = isinstance(value, list)
    return [decode(v, f"image[{k}]" if many else "image", max_pixels) for k, v in enumerate(items)]


def encode_png(pixels: np.ndarray) -> str:
    """RGB pixels -> the base64 text of their PNG (warm-up pictures)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.asarray(pixels, np.uint8)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")
