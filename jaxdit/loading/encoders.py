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
from converters.t5 import WAN_T5_FILE, open_t5
from jaxdit.text_encoders import clip as clip_model
from jaxdit.text_encoders import t5 as t5_model
from jaxdit.text_encoders.common import default_dtype, parameter_shapes, resolve_device
from jaxdit.text_encoders.encoders import FluxTextEncoders, WanImageEncoder, WanTextEncoder

__all__ = [
    "WAN_TOKENIZER_DIR",
    "load_clip_text",
    "load_clip_vision",
    "load_flux_text_encoders",
    "load_module",
    "load_t5",
    "load_wan_image_encoder",
    "load_wan_text_encoder",
]

PathLike = str | os.PathLike[str]
#: Wan's original release keeps the umT5 tokenizer here.
WAN_TOKENIZER_DIR = Path("google") / "umt5-xxl"


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


def _tokenizer(path: Path) -> Any:
    if not path.is_dir():
        raise CheckpointError(f"{path}: no tokenizer folder")
    from transformers import AutoTokenizer  # deferred: importing transformers takes seconds

    return AutoTokenizer.from_pretrained(str(path))


def load_flux_text_encoders(
    folder: PathLike,
    dtype: Any = None,
    device: jax.Device | None = None,
    *,
    compiler_options: Mapping[str, Any] | None = None,
) -> FluxTextEncoders:
    """From a diffusers FluxPipeline folder: ``text_encoder/`` + ``tokenizer/`` (CLIP), ``text_encoder_2/``
    + ``tokenizer_2/`` (T5). ``dtype`` defaults to the checkpoints' (float16 -> float32); ``device`` to
    ``jax.local_devices()[0]``."""
    folder = Path(folder)
    device = resolve_device(device)
    return FluxTextEncoders(
        load_clip_text(folder / "text_encoder", device=device, dtype=dtype),
        load_t5(folder / "text_encoder_2", device=device, dtype=dtype),
        _tokenizer(folder / "tokenizer"),
        _tokenizer(folder / "tokenizer_2"),
        compiler_options=compiler_options,
    )


def _wan_text_paths(folder: Path) -> tuple[Path, Path]:
    """(encoder checkpoint, tokenizer folder) of a diffusers WanPipeline folder or Wan's original one."""
    if (folder / "text_encoder").is_dir():
        return folder / "text_encoder", folder / "tokenizer"
    if (folder / WAN_T5_FILE).is_file():
        return folder / WAN_T5_FILE, folder / WAN_TOKENIZER_DIR
    raise CheckpointError(
        f"{folder}: neither a diffusers WanPipeline folder (text_encoder/, tokenizer/) nor Wan's original "
        f"folder ({WAN_T5_FILE}, {WAN_TOKENIZER_DIR}/)"
    )


def load_wan_text_encoder(
    folder: PathLike,
    dtype: Any = None,
    device: jax.Device | None = None,
    *,
    compiler_options: Mapping[str, Any] | None = None,
) -> WanTextEncoder:
    """From a diffusers WanPipeline folder (``text_encoder/``, ``tokenizer/``) or Wan's original folder
    (``models_t5_umt5-xxl-enc-bf16.pth``, ``google/umt5-xxl/``)."""
    checkpoint, tokenizer = _wan_text_paths(Path(folder))
    return WanTextEncoder(
        load_t5(checkpoint, device=device, dtype=dtype),
        _tokenizer(tokenizer),
        compiler_options=compiler_options,
    )


def load_wan_image_encoder(
    folder: PathLike,
    dtype: Any = None,
    device: jax.Device | None = None,
    *,
    compiler_options: Mapping[str, Any] | None = None,
) -> WanImageEncoder:
    """From a diffusers WanImageToVideoPipeline folder: ``image_encoder/`` + ``image_processor/``."""
    folder = Path(folder)
    if not (folder / "image_processor").is_dir():
        raise CheckpointError(f"{folder}: no image_processor/ folder (a diffusers Wan I2V pipeline has one)")
    from transformers import CLIPImageProcessor  # deferred: importing transformers takes seconds

    processor = CLIPImageProcessor.from_pretrained(str(folder / "image_processor"))
    return WanImageEncoder(
        load_clip_vision(folder / "image_encoder", device=device, dtype=dtype),
        processor,
        compiler_options=compiler_options,
    )
