"""Text and image encoders from a model folder, each on one device: the checkpoint side of
``jaxdit.text_encoders``.

Weights come through the converters (``converters/t5.py``, ``converters/clip.py``: transformers folders,
sharded or not, and Wan's original ``.pth``, read weights-only), every tensor placed straight on the
encoder's device; tokenizers and image processors come from the folder through transformers. What the
encoders compute, and why they sit on one device, is in ``jaxdit/text_encoders/encoders.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from converters.clip import open_clip_text, open_clip_vision
from converters.errors import CheckpointError
from converters.safetensors_io import LazyTensor, place
from converters.t5 import open_t5
from jaxdit.text_encoders import clip as clip_model
from jaxdit.text_encoders import t5 as t5_model
from jaxdit.text_encoders.common import default_dtype, parameter_shapes, resolve_device

__all__ = ["load_clip_text", "load_clip_vision", "load_module", "load_t5", "load_tokenizer"]

PathLike = str | os.PathLike[str]


def load_module(
    abstract: nnx.Module, tensors: Mapping[str, LazyTensor], device: jax.Device, dtype: Any
) -> nnx.Module:
    """Place every lazy target on ``device`` in ``dtype`` and merge them into the abstract module."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    key = lambda path: ".".join(map(str, path))
    arrays = {key(p): place(tensors[key(p)], sharding, dtype=dtype) for p, _ in flat}
    return nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(arrays[key(p)])) for p, v in flat]))


def _load(opened: Any, abstract: Callable[[Any, Any], Any], device: Any, dtype: Any) -> Any:
    dtype = dtype if dtype is not None else default_dtype(opened.dtype)
    model = abstract(opened.config, dtype)
    tensors = opened.resolve(parameter_shapes(model))
    return load_module(model, tensors, resolve_device(device), dtype)


def load_t5(path: PathLike, *, device: jax.Device | None = None, dtype: Any = None) -> t5_model.T5Encoder:
    """A T5/umT5 encoder (transformers folder, or Wan's ``.pth``) with its weights on ``device``."""
    return _load(open_t5(path), t5_model.abstract_model, device, dtype)


def load_clip_text(
    path: PathLike, *, device: jax.Device | None = None, dtype: Any = None
) -> clip_model.CLIPTextModel:
    """A CLIP text model (transformers ``CLIPTextModel`` folder) with its weights on ``device``."""
    return _load(open_clip_text(path), clip_model.abstract_text_model, device, dtype)


def load_clip_vision(
    path: PathLike, *, device: jax.Device | None = None, dtype: Any = None
) -> clip_model.CLIPVisionModel:
    """A CLIP vision model (transformers ``CLIPVisionModel`` folder) with its weights on ``device``."""
    return _load(open_clip_vision(path), clip_model.abstract_vision_model, device, dtype)


def load_tokenizer(path: Path) -> Any:
    if not path.is_dir():
        raise CheckpointError(f"{path}: no tokenizer folder")
    from transformers import AutoTokenizer  # deferred: importing transformers takes seconds

    return AutoTokenizer.from_pretrained(str(path))
