"""Z-Image LoRA layouts, mapped onto jaxdit parameters through the diffusers and original key tables of
``converters/z_image.py`` (diffusers' ``_convert_non_diffusers_z_image_lora_to_diffusers`` in
``src/diffusers/loaders/lora_conversion_utils.py`` shows the layouts).

- ``diffusers`` (PEFT; diffusers' trainers, ai-toolkit): ``transformer.layers.0.attention.to_q.lora_A
  .weight`` / ``lora_B.weight`` (``lora_B.bias``), also under ``diffusion_model.`` or without a prefix;
  the scale from PEFT's config in the header, else ``.alpha`` keys, else 1.
- ``comfyui``: the original module names (fused ``attention.qkv``, ``attention.out``, ``x_embedder``,
  ``final_layer``) under ``diffusion_model.`` (or ``model.diffusion_model.``, or none), ``lora_down`` /
  ``lora_up`` or ``lora_A`` / ``lora_B``, optional ``.alpha``, ``.diff`` / ``.diff_b`` full deltas; the
  fused qkv splits as the base weights do.
- ``kohya`` (sd-scripts, musubi-tuner): ``lora_unet_layers_0_attention_to_q.lora_down.weight`` /
  ``.lora_up.weight`` / ``.alpha``: diffusers module names with underscores.
- ``kohya-original``: the same on the original module tree (``lora_unet_layers_0_attention_qkv``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from converters.lora.core import COMFY_PREFIXES, COMFY_SUFFIXES, KOHYA_SUFFIXES, PEFT_SUFFIXES, LoraLayout
from converters.lora.family import LoraFamily, register_lora_family
from converters.z_image import diffusers_table, original_table
from jaxdit.models.z_image import parameter_shapes
from jaxdit.models.z_image_config import ZImageConfig

__all__ = ["describe", "layouts", "looks_like"]

_SIGNATURE = re.compile(r"(layers|noise_refiner|context_refiner)[._]\d+[._](attention|feed_forward|adaLN)")


def layouts(cfg: ZImageConfig) -> list[LoraLayout]:
    """Every Z-Image layout for a model of ``cfg``, in the order detection tries them."""
    diffusers, original = diffusers_table(cfg), original_table(cfg)
    prefixes = ("transformer.", "diffusion_model.", "model.diffusion_model.", "")
    return [
        LoraLayout("z-image", "diffusers", diffusers, prefixes, PEFT_SUFFIXES, "peft"),
        LoraLayout("z-image", "comfyui", original, COMFY_PREFIXES, COMFY_SUFFIXES, "optional"),
        LoraLayout(
            "z-image", "kohya", diffusers, ("lora_unet_",), KOHYA_SUFFIXES, "optional", underscored=True
        ),
        LoraLayout(
            "z-image",
            "kohya-original",
            original,
            ("lora_unet_",),
            KOHYA_SUFFIXES,
            "optional",
            underscored=True,
        ),
    ]


def looks_like(keys: Iterable[str]) -> bool:
    """Whether keys name Z-Image blocks (to tell a user that a LoRA is for Z-Image, not their model)."""
    return any(_SIGNATURE.search(k) for k in keys)


def describe(cfg: ZImageConfig) -> str:
    """The model in a few words, for messages."""
    return f"{cfg.n_refiner_layers} + {cfg.n_refiner_layers} refiner and {cfg.n_layers} joint blocks of width {cfg.dim}"


LORA = register_lora_family(
    LoraFamily("z-image", ZImageConfig, layouts, looks_like, describe, parameter_shapes)
)
