"""Wan 2.1 / 2.2 LoRA layouts, mapped onto jaxdit parameters through the original and diffusers key
tables of ``converters/wan.py`` (diffusers' ``src/diffusers/loaders/lora_conversion_utils.py`` shows each
layout). Wan 2.2's two experts are two models: a LoRA is read for one model at a time.

- ``comfyui`` (ComfyUI, lightx2v's distillation LoRAs, most hub files): original module names with the
  ``diffusion_model.`` prefix, ``lora_down``/``lora_up`` or ``lora_A``/``lora_B``, optional ``.alpha``
  (scale alpha / rank, else 1), ``.diff`` / ``.diff_b`` full deltas of weights and biases (norms and the
  modulation tables too: they go through the same table, drop-unit-axis hook included).
- ``musubi`` (kohya's musubi-tuner): ``lora_unet_blocks_0_self_attn_q.lora_down.weight`` / ``.lora_up.weight``
  / ``.alpha``: original module names with underscores; alpha required.
- ``diffusers`` (PEFT): ``blocks.0.attn1.to_q.lora_A.weight`` / ``lora_B.weight`` (``lora_B.bias``), with or
  without the ``transformer.`` prefix; scale from PEFT's config in the header, else ``.alpha`` keys, else 1.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from converters.lora.core import COMFY_PREFIXES, COMFY_SUFFIXES, KOHYA_SUFFIXES, PEFT_SUFFIXES, LoraLayout
from converters.lora.family import LoraFamily, register_lora_family
from converters.wan import diffusers_table, original_table
from jaxdit.models.wan import WanConfig, parameter_shapes

__all__ = ["describe", "layouts", "looks_like"]

_SIGNATURE = re.compile(r"blocks[._]\d+[._](self_attn|cross_attn|attn1|attn2|ffn)[._]")


def layouts(cfg: WanConfig) -> list[LoraLayout]:
    """Every Wan layout for a model of ``cfg``, in the order detection tries them."""
    original, diffusers = original_table(cfg), diffusers_table(cfg)
    return [
        LoraLayout("wan", "comfyui", original, COMFY_PREFIXES, COMFY_SUFFIXES, "optional"),
        LoraLayout("wan", "musubi", original, ("lora_unet_",), KOHYA_SUFFIXES, "required", underscored=True),
        LoraLayout("wan", "diffusers", diffusers, ("transformer.", ""), PEFT_SUFFIXES, "peft"),
    ]


def looks_like(keys: Iterable[str]) -> bool:
    """Whether keys name Wan blocks (to tell a user that a LoRA is for Wan, not their model)."""
    return any(_SIGNATURE.search(k) for k in keys)


def describe(cfg: WanConfig) -> str:
    """The model in a few words, for messages."""
    return f"{'I2V' if cfg.is_i2v else 'T2V'}, {cfg.num_layers} blocks of width {cfg.dim}"


LORA = register_lora_family(LoraFamily("wan", WanConfig, layouts, looks_like, describe, parameter_shapes))
