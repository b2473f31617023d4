"""HunyuanVideo 1.5 LoRA layouts, mapped onto jaxdit parameters through the diffusers key table of
``converters/hunyuan_video15.py``.

- ``diffusers`` (PEFT; diffusers' and musubi-style trainers that save through PEFT):
  ``transformer.transformer_blocks.0.attn.to_q.lora_A.weight`` / ``lora_B.weight`` (``lora_B.bias``),
  the token refiner's ``context_embedder.token_refiner.refiner_blocks.0.attn.to_q``, the glyph mapper's
  ``context_embedder_2.linear_1``, the patch embedding's Conv3d ``x_embedder.proj`` (its full delta),
  also without the ``transformer.`` prefix; the scale from PEFT's config in the header, else ``.alpha``
  keys, else 1.
- ``comfyui``: ComfyUI's module tree (``comfy/lora.py`` serves it for HunyuanVideo models) under
  ``diffusion_model.`` (or ``model.diffusion_model.``, or none): ``double_blocks.0.img_attn.qkv`` (fused;
  its update's rows split as the base weight's), ``img_mod.lin``, ``img_mlp.0``, ``txt_in.t_embedder
  .in_layer``, ``txt_in.individual_token_refiner.blocks.0.self_attn.qkv``, ``final_layer.adaLN_modulation
  .1`` ((shift, scale): the update's halves swap); ``lora_down`` / ``lora_up`` or ``lora_A`` / ``lora_B``,
  optional ``.alpha``, ``.diff`` / ``.diff_b`` full deltas.
- ``original``: Tencent's module names (``double_blocks.0.img_attn_q``, ``img_mod.linear``,
  ``img_mlp.fc1``, ``txt_in.individual_token_refiner.blocks.0.self_attn_qkv``), under ``diffusion_model.``,
  ``transformer.`` or none, the same suffixes.
- ``comfyui-original``: the same with the double blocks' fused ``img_attn_qkv`` / ``txt_attn_qkv`` (the
  names of Comfy-Org's file; diffusion-pipe's ``transformer.`` files, which ComfyUI also reads).
- ``kohya-original`` (musubi-tuner) and ``kohya``: ``lora_unet_double_blocks_0_img_attn_q.lora_down
  .weight`` / ``.lora_up.weight`` / ``.alpha``: Tencent's or ComfyUI's module names with underscores.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from converters.hunyuan_video15 import comfy_table, diffusers_table, original_table
from converters.lora.core import COMFY_PREFIXES, COMFY_SUFFIXES, KOHYA_SUFFIXES, PEFT_SUFFIXES, LoraLayout
from converters.lora.family import LoraFamily, register_lora_family
from jaxdit.models.hunyuan_video15 import parameter_shapes
from jaxdit.models.hunyuan_video15_config import HunyuanVideo15Config

__all__ = ["describe", "layouts", "looks_like"]

#: Module names only HunyuanVideo 1.5 has: the ByT5 glyph mapper, the image-to-video type embedding
#: and the SigLIP image projection (diffusers' and the original names).
_SIGNATURE = re.compile(
    r"context_embedder_2[._](linear_[123]|norm)|cond_type_embed|image_embedder[._]linear_[12]"
    r"|vision_in[._]proj[._][0134]|byt5_in[._](fc[123]|layernorm)"
)


def layouts(cfg: HunyuanVideo15Config) -> list[LoraLayout]:
    """Every HunyuanVideo 1.5 layout for a model of ``cfg``, in the order detection tries them."""
    original, fused, comfy = original_table(cfg), original_table(cfg, fused_qkv=True), comfy_table(cfg)
    prefixes = ("diffusion_model.", "model.diffusion_model.", "transformer.", "")
    family = "hunyuan-video15"
    return [
        LoraLayout(family, "diffusers", diffusers_table(cfg), ("transformer.", ""), PEFT_SUFFIXES, "peft"),
        LoraLayout(family, "comfyui", comfy, COMFY_PREFIXES, COMFY_SUFFIXES, "optional"),
        LoraLayout(family, "original", original, prefixes, COMFY_SUFFIXES, "optional"),
        LoraLayout(family, "comfyui-original", fused, prefixes, COMFY_SUFFIXES, "optional"),
        LoraLayout(
            family, "kohya-original", original, ("lora_unet_",), KOHYA_SUFFIXES, "optional", underscored=True
        ),
        LoraLayout(family, "kohya", comfy, ("lora_unet_",), KOHYA_SUFFIXES, "optional", underscored=True),
    ]


def looks_like(keys: Iterable[str]) -> bool:
    """Whether keys name HunyuanVideo 1.5-only modules (to tell a user which model a LoRA is for)."""
    return any(_SIGNATURE.search(k) for k in keys)


def describe(cfg: HunyuanVideo15Config) -> str:
    """The model in a few words, for messages."""
    return (
        f"{cfg.num_layers} dual-stream and {cfg.num_refiner_layers} refiner blocks of width "
        f"{cfg.num_attention_heads * cfg.attention_head_dim}"
    )


LORA = register_lora_family(
    LoraFamily("hunyuan-video15", HunyuanVideo15Config, layouts, looks_like, describe, parameter_shapes)
)
