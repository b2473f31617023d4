"""Reading PyTorch ``.pth`` state dicts, and nothing else: the one place jaxdit calls ``torch.load``.

Wan's original release ships its umT5 encoder and VAE as pickled state dicts. They are read with
``torch.load(path, map_location="cpu", weights_only=True, mmap=True)``: the weights-only unpickler refuses
any object that is not a tensor or a plain container, and mmap leaves the bytes on disk until a tensor is
read. The result must be a flat mapping of names to tensors; anything else is a CheckpointError.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import CheckpointError
from converters.keymap import StateDict

__all__ = ["read_pth", "torch_module"]


def torch_module(purpose: str = "reading a .pth checkpoint") -> Any:
    """``torch``, imported on demand: only .pth files need it (safetensors checkpoints do not)."""
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"{purpose} needs PyTorch (pip install torch; the CPU build is enough); safetensors checkpoints do not"
        ) from None
    return torch


def _as_numpy(tensor: Any, torch: Any) -> np.ndarray:
    """A CPU tensor as a numpy view (no copy for a contiguous one; bfloat16 through ml_dtypes)."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def read_pth(path: str | os.PathLike[str]) -> StateDict:
    """A torch state dict file as a :class:`StateDict` (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    torch = torch_module()
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises several types for damaged or unsafe files
        raise CheckpointError(f"{path}: cannot read as a weights-only torch checkpoint: {e}") from e
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict of tensors")
    arrays = {}
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor; expected a state dict"
            )
        arrays[key] = _as_numpy(value, torch)
    return StateDict(arrays, name=str(path))
