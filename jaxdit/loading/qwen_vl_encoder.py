"""Qwen2.5-VL with its vision tower from a transformers ``Qwen2_5_VLForConditionalGeneration`` folder
(Qwen-Image-Edit's ``text_encoder/``): the decoder LM (``jaxdit.loading.decoder_lm``) and the
``visual.`` tensors, into :class:`~jaxdit.text_encoders.qwen_vl_encoder.QwenVLEncoder`."""

from __future__ import annotations

import os
from pathlib import Path

from converters.checkpoint_files import open_checkpoint
from jaxdit.loading.decoder_lm import load_decoder_lm
from jaxdit.text_encoders.common import read_json
from jaxdit.text_encoders.qwen_vl_encoder import IMAGE_TOKEN_ID, QwenVLEncoder
from jaxdit.text_encoders.qwen_vl_vision import QwenVisionConfig, vision_params

__all__ = ["load_qwen_vl_encoder"]


def load_qwen_vl_encoder(path: str | os.PathLike[str]) -> QwenVLEncoder:
    """A transformers ``Qwen2_5_VLForConditionalGeneration`` folder -> the encoder with its vision tower."""
    folder = Path(path)
    config = read_json(folder / "config.json")
    if config.get("model_type") != "qwen2_5_vl" or "vision_config" not in config:
        raise ValueError(f"{folder}: not a Qwen2.5-VL folder with a vision tower (model_type qwen2_5_vl)")
    model = load_decoder_lm(folder)
    if model.config.mrope_section is None:
        raise ValueError(f"{folder / 'config.json'}: no mrope_section in the text RoPE parameters")
    vision = QwenVisionConfig.from_hf_config(config)
    files = open_checkpoint(folder)
    names = list(files.keys())
    tensors = {k: files.tensor(k) for k in names if "visual." in k}
    image_token = config.get("image_token_id", config.get("text_config", {}).get("image_token_id"))
    return QwenVLEncoder(model, vision, vision_params(tensors, vision), int(image_token or IMAGE_TOKEN_ID))
