"""Qwen-Image's prompt encoder from a diffusers ``QwenImagePipeline`` folder: ``tokenizer/`` and the
Qwen2.5-VL ``text_encoder/``, on one device or sharded over a mesh (``jaxdit.loading.decoder_lm``).

The folder is checked before anything loads: a missing ``text_encoder/`` or ``tokenizer/``, or a text
encoder of another model type, is refused naming the folder expected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from converters.errors import CheckpointError
from jaxdit.loading.decoder_lm import load_decoder_lm
from jaxdit.loading.encoders import load_tokenizer
from jaxdit.text_encoders.decoder_lm import DecoderLMRunner
from jaxdit.text_encoders.qwen_image_prompt import QwenImagePromptEncoder

__all__ = ["load_qwen_image_prompt_encoder"]

#: The text encoder classes' model types Qwen-Image's template and prefix count are made for.
TEXT_ENCODER_TYPES = ("qwen2_5_vl",)


def check_text_encoder_folder(folder: Path) -> None:
    """Raise unless ``folder/text_encoder`` is a Qwen2.5-VL transformers folder and ``folder/tokenizer``
    exists (headers and configs only)."""
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


def load_qwen_image_prompt_encoder(
    folder: str | os.PathLike[str],
    *,
    mesh: Mesh | None = None,
    device: jax.Device | None = None,
    dtype: Any = None,
) -> QwenImagePromptEncoder:
    """The prompt encoder of a ``QwenImagePipeline`` folder: on ``mesh`` (sharded by the decoder-LM rule
    table) or, without one, on ``device``."""
    folder = Path(folder)
    check_text_encoder_folder(folder)
    model = load_decoder_lm(folder / "text_encoder", mesh=mesh, device=device, dtype=dtype)
    return QwenImagePromptEncoder(load_tokenizer(folder / "tokenizer"), DecoderLMRunner(model, mesh))
