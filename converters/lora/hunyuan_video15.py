"""HunyuanVideo 1.5 LoRA layouts, mapped onto jaxdit parameters through the diffusers key table of
``converters/hunyuan_video15.py``.

- ``diffusers`` (PEFT; diffusers' and musubi-style trainers that save through PEFT):
  ``transformer.transformer_blocks.0.attn.to_q.lora_A.weight`` / ``lora_B.weight`` (``lora_B.bias``),
  the token refiner's ``context_embedder.token_refiner.refiner_blocks.0.attn.to_q``, the glyph mapper's
  ``context_embedder_2.linear_1``, the patch embedding's Conv3d ``x_embedder.proj`` (its full delta),
  also without the ``transformer.`` prefix; the scale from PEFT's config in the header, else ``.alpha``
  keys, else 1.

Not read yet: ComfyUI's and the original Tencent checkpoint's module names (``double_blocks.0.img_attn_q``
and the like), which need the original key table that ``converters/hunyuan_video15.py`` does not have.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from converters.hunyuan_video15 import diffusers_table
from converters.lora.core import PEFT_SUFFIXES, LoraLayout
from converters.lora.family import LoraFamily, register_lora_family
from jaxdit.models.hunyuan_video15 import parameter_shapes
from jaxdit.models.hunyuan_video15_config import HunyuanVideo15Config

__all__ = ["describe", "layouts", "looks_like"]

#: Module names only HunyuanVideo 1.5 has: the ByT5 glyph mapper, the image-to-video type embedding
#: and the SigLIP image projection.
_SIGNATURE = re.compile(
    r"context_embedder_2[._](linear_[123]|norm)|cond_type_embed|image_embedder[._]linear_[12]"
)


def layouts(cfg: HunyuanVideo15Config) -> list[LoraLayout]:
    """Every HunyuanVideo 1.5 layout for a model of ``cfg``, in the order detection tries them."""
    return [
        LoraLayout(
            "hunyuan-video15", "diffusers", diffusers_table(cfg), ("transformer.", ""), PEFT_SUFFIXES, "peft"
        )
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
