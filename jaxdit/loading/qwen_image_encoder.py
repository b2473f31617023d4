"""Qwen-Image's prompt encoder from a diffusers ``QwenImagePipeline`` folder: ``tokenizer/`` and the
Qwen2.5-VL ``text_encoder/``, on one device or sharded over a mesh (``jaxdit.loading.decoder_lm``).

The folder is checked before anything loads: a missing ``text_encoder/`` or ``tokenizer/``, or a text
encoder of another model type, is refused naming the folder expected.

The text encoder may instead be ComfyUI's split file (``text_encoders/qwen_2.5_vl_7b.safetensors`` and its
FP8 variants: the Qwen2.5-VL text decoder under ``model.``, the vision tower under ``visual.``, skipped),
given as ``text_encoder=FILE``: its config is the folder's ``text_encoder/config.json`` when there is one,
else Qwen2.5-VL's with the sizes the file's tensors show (heads of 128, as every Qwen2.5-VL size has).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from converters.decoder_lm import config_from_shapes
from converters.errors import CheckpointError
from jaxdit.loading.decoder_lm import load_decoder_lm
from jaxdit.loading.encoders import load_tokenizer
from jaxdit.text_encoders.decoder_lm import DecoderLMRunner
from jaxdit.text_encoders.decoder_lm_config import DecoderLMConfig
from jaxdit.text_encoders.qwen_image_prompt import QwenImagePromptEncoder

__all__ = ["check_text_encoder_folder", "load_qwen_image_prompt_encoder", "text_encoder_config"]

#: The text encoder classes' model types Qwen-Image's template and prefix count are made for.
TEXT_ENCODER_TYPES = ("qwen2_5_vl",)
#: Every Qwen2.5-VL size's head width (what a single file without a config cannot show).
HEAD_DIM = 128


def check_text_encoder_folder(folder: Path, text_encoder: str | os.PathLike[str] | None = None) -> None:
    """Raise unless ``folder/text_encoder`` is a Qwen2.5-VL transformers folder (or ``text_encoder``, a
    single-file encoder, exists) and ``folder/tokenizer`` exists (headers and configs only)."""
    if text_encoder is not None:
        path = Path(text_encoder)
        if not (path.is_file() and path.suffix == ".safetensors"):
            raise CheckpointError(f"{path}: no such .safetensors file (the text encoder given)")
        if not (folder / "tokenizer").is_dir():
            raise CheckpointError(f"{folder}: no tokenizer; expected Qwen2's in {folder / 'tokenizer'}")
        if not (folder / "text_encoder" / "config.json").is_file():
            return
    config = folder / "text_encoder" / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{folder}: no text encoder; expected Qwen2.5-VL in {folder / 'text_encoder'}")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config}: cannot read the config: {e}") from None
    if model_type not in TEXT_ENCODER_TYPES:
        raise CheckpointError(
            f"{config}: a {model_type!r} text encoder; Qwen-Image's is Qwen2.5-VL (model_type 'qwen2_5_vl') "
            f"in {folder / 'text_encoder'}"
        )
    if not (folder / "tokenizer").is_dir():
        raise CheckpointError(f"{folder}: no tokenizer; expected Qwen2's in {folder / 'tokenizer'}")


def text_encoder_config(folder: Path, text_encoder: str | os.PathLike[str]) -> DecoderLMConfig:
    """The config of a single-file encoder: the folder's ``text_encoder/config.json``, else Qwen2.5-VL's
    sized by the file's tensors."""
    config = folder / "text_encoder" / "config.json"
    if config.is_file():
        return DecoderLMConfig.from_hf_config(config)
    return config_from_shapes(text_encoder, DecoderLMConfig.preset("qwen2.5-vl-7b"), HEAD_DIM)


def load_qwen_image_prompt_encoder(
    folder: str | os.PathLike[str],
    *,
    mesh: Mesh | None = None,
    device: jax.Device | None = None,
    dtype: Any = None,
    text_encoder: str | os.PathLike[str] | None = None,
    offload: bool = False,
) -> QwenImagePromptEncoder:
    """The prompt encoder of a ``QwenImagePipeline`` folder: on ``mesh`` (sharded by the decoder-LM rule
    table) or, without one, on ``device``; ``text_encoder``: a single-file encoder (ComfyUI's) used
    instead of the folder's ``text_encoder/``, with the folder's tokenizer; ``offload`` (one device): its
    weights wait in host memory between prompts (``DecoderLMRunner``)."""
    folder = Path(folder)
    check_text_encoder_folder(folder, text_encoder)
    if text_encoder is None:
        model = load_decoder_lm(folder / "text_encoder", mesh=mesh, device=device, dtype=dtype)
    else:
        config = text_encoder_config(folder, text_encoder)
        model = load_decoder_lm(text_encoder, mesh=mesh, device=device, dtype=dtype, config=config)
    return QwenImagePromptEncoder(
        load_tokenizer(folder / "tokenizer"), DecoderLMRunner(model, mesh, offload=offload)
    )
