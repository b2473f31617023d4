"""FLUX.1 LoRA layouts, mapped onto jaxdit parameters through the BFL and diffusers key tables of
``converters/flux.py`` (diffusers' ``src/diffusers/loaders/lora_conversion_utils.py`` shows each layout).

- ``kohya`` (sd-scripts, ai-toolkit's kohya export): ``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``
  / ``.lora_up.weight`` / ``.alpha``: BFL module names with underscores; scale alpha / rank (rank when the
  alpha is missing, as diffusers does). The fused qkv and the single blocks' ``linear1`` / ``linear2``
  split exactly as the base weights do.
- ``bfl`` (ComfyUI): BFL module names with dots, ``diffusion_model.`` (or ``model.diffusion_model.``, or no)
  prefix, ``lora_down``/``lora_up`` or ``lora_A``/``lora_B``, optional ``.alpha``, ``.diff``/``.diff_b`` full
  deltas.
- ``diffusers`` (PEFT; ai-toolkit, diffusers' trainers): ``transformer.transformer_blocks.0.attn.to_q
  .lora_A.weight`` / ``lora_B.weight`` (``lora_B.bias`` with PEFT's ``lora_bias``), with or without the
  ``transformer.`` prefix; the scale comes from PEFT's config in the header (``lora_adapter_metadata``),
  else from ``.alpha`` keys, else 1.
- ``kohya-diffusers``: kohya's spelling of diffusers modules (``lora_transformer_single_transformer_blocks_0
  _attn_to_q``), alpha required.
- ``xlabs`` (XLabs-AI's x-flux): ``double_blocks.0.processor.qkv_lora1.down.weight`` (image qkv; ``lora2``
  the text stream; ``proj_lora1/2`` the projections), ``single_blocks.0.processor.qkv_lora`` (the q, k, v
  rows of ``linear1``) and ``proj_lora`` (``linear2``); no alpha (scale 1).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from converters.flux import bfl_table, diffusers_table
from converters.lora.core import (
    COMFY_PREFIXES,
    COMFY_SUFFIXES,
    DOWN,
    KOHYA_SUFFIXES,
    PEFT_SUFFIXES,
    UP,
    LoraLayout,
    Module,
)
from converters.lora.family import LoraFamily, register_lora_family
from jaxdit.models.flux import FluxConfig, parameter_shapes

__all__ = ["describe", "layouts", "looks_like"]

XLABS_SUFFIXES = {".down.weight": DOWN, ".up.weight": UP}

_XLABS_DOUBLE = {
    "qkv_lora1": "img_attn.qkv",
    "qkv_lora2": "txt_attn.qkv",
    "proj_lora1": "img_attn.proj",
    "proj_lora2": "txt_attn.proj",
}
_SIGNATURE = re.compile(
    r"(double_blocks|single_blocks|transformer_blocks|single_transformer_blocks)[._]\d+[._]"
)


def _xlabs(cfg: FluxConfig):
    e, f = cfg.hidden_size, cfg.mlp_hidden

    def rename(raw: str) -> Module | None:
        match = re.fullmatch(r"(double|single)_blocks\.(\d+)\.processor\.(\w+)", raw)
        if match is None:
            return None
        kind, i, name = match.groups()
        if kind == "double":
            return Module(f"double_blocks.{i}.{_XLABS_DOUBLE[name]}") if name in _XLABS_DOUBLE else None
        if name == "qkv_lora":  # q, k, v: the first 3E of linear1's 3E + F rows
            return Module(f"single_blocks.{i}.linear1", rows=(0, 3 * e, 3 * e + f))
        return Module(f"single_blocks.{i}.linear2") if name == "proj_lora" else None

    return rename


def layouts(cfg: FluxConfig) -> list[LoraLayout]:
    """Every FLUX layout for a model of ``cfg``, in the order detection tries them."""
    bfl, diffusers = bfl_table(cfg), diffusers_table(cfg)
    return [
        LoraLayout("flux", "kohya", bfl, ("lora_unet_",), KOHYA_SUFFIXES, "optional", underscored=True),
        LoraLayout("flux", "bfl", bfl, COMFY_PREFIXES, COMFY_SUFFIXES, "optional"),
        LoraLayout("flux", "diffusers", diffusers, ("transformer.", ""), PEFT_SUFFIXES, "peft"),
        LoraLayout(
            "flux",
            "kohya-diffusers",
            diffusers,
            ("lora_transformer_",),
            KOHYA_SUFFIXES,
            "required",
            underscored=True,
        ),
        LoraLayout(
            "flux", "xlabs", bfl, ("diffusion_model.", ""), XLABS_SUFFIXES, "none", rename=_xlabs(cfg)
        ),
    ]


def looks_like(keys: Iterable[str]) -> bool:
    """Whether keys name FLUX blocks (to tell a user that a LoRA is for FLUX, not their model)."""
    return any(_SIGNATURE.search(k) for k in keys)


def describe(cfg: FluxConfig) -> str:
    """The model in a few words, for messages."""
    return f"{cfg.depth} double and {cfg.depth_single_blocks} single blocks of width {cfg.hidden_size}"


LORA = register_lora_family(LoraFamily("flux", FluxConfig, layouts, looks_like, describe, parameter_shapes))
