"""Writing generated pictures and videos, atomically: a failed write leaves no half-written file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Images in [-1, 1] (any float dtype) -> uint8 in [0, 255]."""
    return np.round((np.clip(np.asarray(images, np.float32), -1.0, 1.0) + 1.0) * 127.5).astype(np.uint8)


def grid(images: np.ndarray, columns: int, pad: int = 1) -> np.ndarray:
    """[N, H, W(, C)] uint8 -> one [rows*(H+pad), columns*(W+pad)(, C)] picture, row-major."""
    n, h, w = images.shape[:3]
    rows = -(-n // columns)
    canvas = np.zeros((rows * (h + pad) + pad, columns * (w + pad) + pad, *images.shape[3:]), images.dtype)
    for i, img in enumerate(images):
        r, c = divmod(i, columns)
        canvas[
            pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w
        ] = img
    return canvas


def _atomic(path: Path, write) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary name is longer than the file's by the random part: a name near the file system's
    # limit (255 bytes) would fail here, after the whole run, so only the start of it is kept.
    # Bytes, not characters: 64 four-byte characters are 256 bytes.
    keep = lambda text, n: os.fsencode(text)[:n].decode(errors="ignore")
    fd, tmp = tempfile.mkstemp(
        prefix=f".{keep(path.stem, 64)}.", suffix=keep(path.suffix, 16), dir=path.parent
    )
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file a normal file's mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_image(path: str | os.PathLike, image: np.ndarray, scale: int = 1) -> Path:
    """Write one uint8 image [H, W] or [H, W, 3] as PNG, optionally enlarged by an integer factor."""
    from PIL import Image

    picture = Image.fromarray(image)
    if scale > 1:
        picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
    return _atomic(Path(path), lambda tmp: picture.save(tmp, format="PNG"))


def save_video(path: str | os.PathLike, frames: Sequence[np.ndarray], fps: int = 16) -> Path:
    """Write uint8 frames [H, W(, 3)] as .mp4 (H.264 through PyAV, the ``video`` extra) or .gif (Pillow).

    MP4 frames need even sides (yuv420p halves the chroma planes); odd ones are padded by one edge row or
    column rather than resized, so no pixel changes.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".mp4", ".gif"):
        raise ValueError(f"videos are written as .mp4 or .gif; got {path.name}")
    frames = [np.asarray(f) for f in frames]
    if not frames:
        raise ValueError("no frames to write")
    for i, f in enumerate(frames):
        if f.dtype != np.uint8 or f.shape != frames[0].shape or f.ndim not in (2, 3):
            raise ValueError(
                f"frame {i} is {f.dtype} {f.shape}; every frame must be uint8 [H, W(, 3)] of the first's "
                f"shape {frames[0].shape}"
            )
    if suffix == ".gif":
        from PIL import Image

        pictures = [Image.fromarray(f) for f in frames]
        return _atomic(
            path,
            lambda tmp: pictures[0].save(
                tmp, format="GIF", save_all=True, append_images=pictures[1:], duration=int(1000 / fps), loop=0
            ),
        )
    try:
        import av
    except ImportError as e:  # checked before the file is touched
        raise ImportError(
            f"writing {path.name} needs PyAV: pip install 'jaxdit[video]' (or write a .gif)"
        ) from e
    return _atomic(path, lambda tmp: _write_mp4(av, tmp, frames, fps))


def _write_mp4(av, tmp: str, frames: list[np.ndarray], fps: int) -> None:
    rgb = [np.repeat(f[..., None], 3, axis=-1) if f.ndim == 2 else f for f in frames]
    h, w = rgb[0].shape[:2]
    pad = ((0, h % 2), (0, w % 2), (0, 0))
    with av.open(tmp, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = w + w % 2, h + h % 2
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18"}  # visually lossless; the default (23) smears small videos
        for f in rgb:
            frame = av.VideoFrame.from_ndarray(
                np.ascontiguousarray(np.pad(f, pad, mode="edge")), format="rgb24"
            )
            container.mux(stream.encode(frame))
        container.mux(stream.encode())  # flush the encoder


def save_array(path: str | os.PathLike, array: np.ndarray) -> Path:
    """Write a numpy array (.npy) atomically."""

    # Through a file object: given a name without ".npy", np.save would write to name + ".npy" instead.
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.save(f, array)

    return _atomic(Path(path), write)
