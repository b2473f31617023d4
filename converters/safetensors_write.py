"""Writing a safetensors file atomically, without torch.

The bytes go to a temporary file in the destination folder, which is fsynced and renamed over the final
name (then the folder is fsynced), so an interrupted export never leaves a half-written checkpoint under
the final name: a reader sees the old file or the complete new one. The layout follows the reference
writer (https://github.com/huggingface/safetensors): widest dtype first, header padded to 8 bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from converters.safetensors_header import _HEADER_LEN_BYTES, _TAGS

__all__ = ["write_safetensors"]

PathLike = str | os.PathLike[str]
_WRITE_CHUNK_BYTES = 64 * 1024 * 1024


def write_safetensors(
    path: PathLike, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``tensors`` to ``path`` in safetensors format, atomically.

    The bytes go to a temporary file in the destination folder, which is fsynced and then renamed over
    ``path``: a reader sees the old file or the complete new one, never a partial write. Tensors are laid
    out widest dtype first (then by name), which keeps every tensor aligned to its item size, as the
    reference writer does. Returns the path written.
    """
    path = Path(path)
    metadata = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must map str to str")

    arrays: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        arr = np.asarray(value)
        if arr.dtype.newbyteorder("=") not in _TAGS or (arr.dtype.byteorder == ">" and arr.itemsize > 1):
            raise TypeError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors equivalent")
        # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
        arrays[name] = arr if arr.flags.c_contiguous else arr.copy(order="C")

    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        arr = arrays[name]
        header[name] = {
            "dtype": _TAGS[arr.dtype.newbyteorder("=")],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad with spaces (valid JSON whitespace) so the data section starts 8-byte aligned.
    header_bytes += b" " * (-(len(header_bytes) + _HEADER_LEN_BYTES) % 8)

    path.parent.mkdir(parents=True, exist_ok=True)
    # os.open with mode 0o666 lets the umask decide the permissions, as a plain open() would (mkstemp
    # would make the final file 0600).
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(header_bytes).to_bytes(_HEADER_LEN_BYTES, "little"))
            f.write(header_bytes)
            for name in order:
                flat = arrays[name].reshape(-1).view(np.uint8)
                for start in range(0, flat.size, _WRITE_CHUNK_BYTES):
                    f.write(flat[start : start + _WRITE_CHUNK_BYTES].data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable. Best effort: some filesystems do not allow opening a directory."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
