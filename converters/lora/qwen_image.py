"""Qwen-Image LoRA layouts, mapped onto jaxdit parameters through the diffusers key table of
``converters/qwen_image.py`` (Qwen-Image's own release uses diffusers' module names; diffusers'
``lora_conversion_utils._convert_non_diffusers_qwen_lora_to_diffusers`` shows the other two):

- ``diffusers`` (PEFT): ``transformer_blocks.0.attn.to_q.lora_A.weight`` / ``lora_B.weight``, with or
  without the ``transformer.`` prefix; scale from PEFT's config in the header, else ``.alpha`` keys, else 1.
  lightx2v's Qwen-Image-Lightning 4/8-step distillation LoRAs read as this layout: unprefixed module
  names with ``lora_down``/``lora_up`` (later releases ``lora_A``/``lora_B``) and an ``.alpha`` per module
  (8 at rank 64: a scale of 1/8, which diffusers applies the same way).
- ``comfyui``: the same module names with ComfyUI's ``diffusion_model.`` prefix, ``lora_down``/``lora_up``
  or ``lora_A``/``lora_B``, optional ``.alpha`` (alpha / rank, else 1).
- ``kohya`` (kohya's sd-scripts / musubi-tuner): ``lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight``
  / ``.lora_up.weight`` / ``.alpha``: the module names with underscores; alpha required.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from converters.lora.core import COMFY_PREFIXES, COMFY_SUFFIXES, KOHYA_SUFFIXES, PEFT_SUFFIXES, LoraLayout
from converters.lora.family import LoraFamily, register_lora_family
from converters.qwen_image import diffusers_table
from jaxdit.models.qwen_image import parameter_shapes
from jaxdit.models.qwen_image_config import QwenImageConfig

__all__ = ["LORA", "describe", "layouts", "looks_like"]

_SIGNATURE = re.compile(r"transformer_blocks[._]\d+[._](img_mod|txt_mod|img_mlp|txt_mlp|attn[._]add_)")


def layouts(cfg: QwenImageConfig) -> list[LoraLayout]:
    """Every Qwen-Image layout for a model of ``cfg``, in the order detection tries them (PEFT's first:
    its unprefixed keys would otherwise read as ComfyUI's and lose PEFT's scale)."""
    table = diffusers_table(cfg)
    comfy = tuple(p for p in COMFY_PREFIXES if p)
    return [
        LoraLayout("qwen-image", "diffusers", table, ("transformer.", ""), PEFT_SUFFIXES, "peft"),
        LoraLayout("qwen-image", "comfyui", table, comfy, COMFY_SUFFIXES, "optional"),
        LoraLayout(
            "qwen-image", "kohya", table, ("lora_unet_",), KOHYA_SUFFIXES, "required", underscored=True
        ),
    ]


def looks_like(keys: Iterable[str]) -> bool:
    """Whether keys name Qwen-Image blocks (to tell a user that a LoRA is for Qwen-Image, not their model)."""
    return any(_SIGNATURE.search(k) for k in keys)


def describe(cfg: QwenImageConfig) -> str:
    """The model in a few words, for messages."""
    return f"{cfg.num_layers} dual-stream blocks of width {cfg.hidden_size}"


LORA = register_lora_family(
    LoraFamily("qwen-image", QwenImageConfig, layouts, looks_like, describe, parameter_shapes)
)
