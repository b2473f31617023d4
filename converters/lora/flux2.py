"""FLUX.2 LoRA layouts, mapped onto jaxdit parameters through the diffusers and BFL key tables of
``converters/flux2.py`` (diffusers' ``Flux2LoraLoaderMixin.lora_state_dict`` and the FLUX.2 converters in
``src/diffusers/loaders/lora_conversion_utils.py`` show the layouts).

- ``diffusers`` (PEFT; diffusers' trainers): ``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``
  / ``lora_B.weight`` (``lora_B.bias``), the single blocks' fused ``attn.to_qkv_mlp_proj`` and
  ``attn.to_out``, also without the prefix; the scale from PEFT's config in the header, else ``.alpha``
  keys, else 1.
- ``bfl`` (ai-toolkit, ComfyUI): BFL's module names (``double_blocks.0.img_attn.qkv``, ``img_mlp.0``,
  ``single_blocks.0.linear1`` / ``linear2``, ``final_layer.adaLN_modulation.1``) under ``diffusion_model.``
  (or ``model.diffusion_model.``, or none), ``lora_A`` / ``lora_B`` or ``lora_down`` / ``lora_up``,
  optional ``.alpha``, ``.diff`` / ``.diff_b`` full deltas. The fused tensors split exactly as the base
  weights do (q, k, v rows; a SwiGLU's gate and value rows; ``linear2``'s attention and MLP columns), and
  the final modulation's (shift, scale) halves are swapped into diffusers' order as the base weight's are.
- ``kohya`` (sd-scripts, musubi-tuner): ``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`` /
  ``.lora_up.weight`` / ``.alpha``: BFL module names with underscores; scale alpha / rank (1 without alpha).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from converters.flux2 import bfl_table, diffusers_table
from converters.lora.core import COMFY_PREFIXES, COMFY_SUFFIXES, KOHYA_SUFFIXES, PEFT_SUFFIXES, LoraLayout
from converters.lora.family import LoraFamily, register_lora_family
from jaxdit.models.flux2 import parameter_shapes
from jaxdit.models.flux2_config import Flux2Config

__all__ = ["describe", "layouts", "looks_like"]

#: Module names FLUX.2 has and FLUX.1 has not: the shared modulations, the single blocks' fused
#: projection and the SwiGLU's ``linear_in``.
_SIGNATURE = re.compile(
    r"(double|single)_stream_modulation|to_qkv_mlp_proj|transformer_blocks[._]\d+[._]ff(_context)?[._]linear_in"
)


def layouts(cfg: Flux2Config) -> list[LoraLayout]:
    """Every FLUX.2 layout for a model of ``cfg``, in the order detection tries them."""
    diffusers, bfl = diffusers_table(cfg), bfl_table(cfg)
    return [
        LoraLayout("flux2", "diffusers", diffusers, ("transformer.", ""), PEFT_SUFFIXES, "peft"),
        LoraLayout("flux2", "bfl", bfl, COMFY_PREFIXES, COMFY_SUFFIXES, "optional"),
        LoraLayout("flux2", "kohya", bfl, ("lora_unet_",), KOHYA_SUFFIXES, "optional", underscored=True),
    ]


def looks_like(keys: Iterable[str]) -> bool:
    """Whether keys name FLUX.2-only modules (to tell a user that a LoRA is for FLUX.2, not their model)."""
    return any(_SIGNATURE.search(k) for k in keys)


def describe(cfg: Flux2Config) -> str:
    """The model in a few words, for messages."""
    return f"{cfg.num_layers} double and {cfg.num_single_layers} single blocks of width {cfg.hidden_size}"


LORA = register_lora_family(LoraFamily("flux2", Flux2Config, layouts, looks_like, describe, parameter_shapes))
