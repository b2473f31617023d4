"""Decoder-LM text encoder checkpoints (transformers layout) -> jaxdit parameters
(``jaxdit/text_encoders/decoder_lm.py``).

The folder people download: ``config.json`` plus ``model.safetensors`` or shards named by
``model.safetensors.index.json`` (a diffusers pipeline's ``text_encoder/``). The text decoder's tensors sit
under a prefix that depends on the class and the transformers version that saved it: ``model.`` for a
``*ForCausalLM`` (and transformers 4.x's ``Qwen2_5_VLForConditionalGeneration``), ``model.language_model.``
for the multimodal classes since transformers 4.52, none for a bare ``Qwen3Model``/``MistralModel``. The
prefix is the one in front of ``embed_tokens.weight``.

Strict, in the converters' way: every tensor is consumed by the key table or belongs to a group that is
named and skipped because a text encoder does not use it (the vision tower and multimodal projector of
Qwen2.5-VL / Mistral3, the LM head). Anything else is an error naming the key and the file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import CheckpointError
from converters.keymap import IDENTITY, TRANSPOSE, KeyRule, KeyTable, Without, resolve, where
from converters.safetensors_io import LazyTensor, open_checkpoint
from jaxdit.text_encoders.decoder_lm_config import DecoderLMConfig

__all__ = ["SKIPPED_GROUPS", "DecoderLMCheckpoint", "hf_table", "open_decoder_lm"]

LAYERS = "layers"
#: Where a checkpoint keeps the text decoder, most specific first.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.", "")
#: Tensors a text encoder does not use, by what they are: recognised and skipped, not an error.
SKIPPED_GROUPS: dict[str, tuple[str, ...]] = {
    "vision tower": ("visual.", "model.visual.", "vision_tower.", "model.vision_tower."),
    "multimodal projector": ("multi_modal_projector.", "model.multi_modal_projector."),
    "LM head": ("lm_head.", "language_model.lm_head."),
}


def hf_table(cfg: DecoderLMConfig) -> KeyTable:
    """The text decoder's tensors (keys relative to its prefix) -> jaxdit parameters."""
    layer = "layers.{i}"

    def stacked(target: str, source: str, hook=IDENTITY) -> KeyRule:
        return KeyRule(f"{LAYERS}.{target}", f"{layer}.{source}", hook, LAYERS)

    rules = [
        KeyRule("embed_tokens", "embed_tokens.weight"),
        stacked("input_layernorm", "input_layernorm.weight"),
    ]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        rules.append(stacked(f"{name}.kernel", f"self_attn.{name}.weight", TRANSPOSE))
        if cfg.o_bias if name == "o_proj" else cfg.qkv_bias:
            rules.append(stacked(f"{name}.bias", f"self_attn.{name}.bias"))
    if cfg.qk_norm:
        rules += [stacked("q_norm", "self_attn.q_norm.weight"), stacked("k_norm", "self_attn.k_norm.weight")]
    rules.append(stacked("post_attention_layernorm", "post_attention_layernorm.weight"))
    for name in ("gate_proj", "up_proj", "down_proj"):
        rules.append(stacked(f"{name}.kernel", f"mlp.{name}.weight", TRANSPOSE))
    rules.append(KeyRule("norm", "norm.weight"))
    return KeyTable(f"{cfg.model_type} text decoder", tuple(rules), {LAYERS: cfg.num_hidden_layers})


def _skipped(keys: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key in keys:
        for group, prefixes in SKIPPED_GROUPS.items():
            if key.startswith(prefixes):
                out.setdefault(group, []).append(key)
                break
    return out


@dataclasses.dataclass
class DecoderLMCheckpoint:
    """An opened text-encoder folder: its tensors, config, key table, text prefix and skipped groups."""

    ckpt: Any
    config: DecoderLMConfig
    table: KeyTable
    prefix: str
    skipped: dict[str, int]  # group -> number of tensors recognised and not loaded

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.ckpt.tensor(self.prefix + "embed_tokens.weight").dtype)

    def resolve(self, expected: Mapping[str, tuple[int, ...]]) -> dict[str, LazyTensor]:
        return resolve(self.table, self.ckpt, expected, prefix=self.prefix)


def open_decoder_lm(
    path: str | os.PathLike[str], config: DecoderLMConfig | None = None
) -> DecoderLMCheckpoint:
    """Open a transformers text-encoder folder (headers only). ``config`` overrides the folder's
    ``config.json`` (its shapes are still checked against every tensor)."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder; a decoder-LM text encoder is a transformers folder")
    if config is None:
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"{folder}: no config.json (a transformers text-encoder folder has one)")
        try:
            config = DecoderLMConfig.from_hf_config(folder / "config.json")
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise CheckpointError(
                f"{folder / 'config.json'}: not a decoder-LM text encoder config: {e}"
            ) from None
    files = open_checkpoint(folder)
    keys = list(files.keys())
    prefix = next((p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in files), None)
    if prefix is None:
        raise CheckpointError(
            f"{where(files)}: no token embedding (embed_tokens.weight under any of the prefixes "
            f"{', '.join(repr(p) for p in TEXT_PREFIXES if p)}); not a decoder-LM checkpoint"
        )
    skipped = _skipped(keys)
    dropped = {k for group in skipped.values() for k in group}
    return DecoderLMCheckpoint(
        Without(files, dropped), config, hf_table(config), prefix, {g: len(v) for g, v in skipped.items()}
    )
