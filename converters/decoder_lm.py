"""Decoder-LM text encoder checkpoints (transformers layout) -> jaxdit parameters
(``jaxdit/text_encoders/decoder_lm.py``).

The folder people download: ``config.json`` plus ``model.safetensors`` or shards named by
``model.safetensors.index.json`` (a diffusers pipeline's ``text_encoder/``); or one ``.safetensors`` file
with the config given (ComfyUI's split text-encoder files, e.g. ``qwen_2.5_vl_7b.safetensors``: the text
decoder under ``model.``, the vision tower under ``visual.``, FP8 variants dequantized on read), whose
config :func:`config_from_shapes` can read off its tensors. The text decoder's tensors sit
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

__all__ = ["SKIPPED_GROUPS", "DecoderLMCheckpoint", "config_from_shapes", "hf_table", "open_decoder_lm"]

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


def _text_prefix(files: Any) -> str:
    prefix = next((p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in files), None)
    if prefix is None:
        raise CheckpointError(
            f"{where(files)}: no token embedding (embed_tokens.weight under any of the prefixes "
            f"{', '.join(repr(p) for p in TEXT_PREFIXES if p)}); not a decoder-LM checkpoint"
        )
    return prefix


def config_from_shapes(path: str | os.PathLike[str], base: DecoderLMConfig, head_dim: int) -> DecoderLMConfig:
    """``base`` with the sizes a single-file checkpoint's tensors show (a file without a ``config.json``,
    as ComfyUI ships text encoders): vocabulary, widths, layers, and the heads at ``head_dim`` each (a
    q/k/v projection shows only heads x head width). Headers only."""
    with open_checkpoint(path) as files:
        return _sized(files, base, head_dim)


def _sized(files: Any, base: DecoderLMConfig, head_dim: int) -> DecoderLMConfig:
    prefix = _text_prefix(files)
    shape = lambda key: tuple(files.shape(prefix + key))  # noqa: E731
    layers = 0
    while prefix + f"layers.{layers}.input_layernorm.weight" in files:
        layers += 1
    vocab, hidden = shape("embed_tokens.weight")
    q, k = shape("layers.0.self_attn.q_proj.weight")[0], shape("layers.0.self_attn.k_proj.weight")[0]
    if q % head_dim or k % head_dim:
        raise CheckpointError(
            f"{where(files)}: q/k projections of {q}/{k} features are no whole number of {head_dim}-wide heads"
        )
    return dataclasses.replace(
        base,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=shape("layers.0.mlp.gate_proj.weight")[0],
        num_hidden_layers=layers,
        num_attention_heads=q // head_dim,
        num_key_value_heads=k // head_dim,
        head_dim=head_dim,
        qkv_bias=prefix + "layers.0.self_attn.q_proj.bias" in files,
        qk_norm=prefix + "layers.0.self_attn.q_norm.weight" in files,
    )


def open_decoder_lm(
    path: str | os.PathLike[str], config: DecoderLMConfig | None = None, *, layers: int | None = None
) -> DecoderLMCheckpoint:
    """Open a transformers text-encoder folder, or one ``.safetensors`` file when ``config`` is given
    (headers only). ``config`` overrides the folder's ``config.json`` (its shapes are still checked
    against every tensor). ``layers``: keep only the first ``layers`` decoder layers (an encoder whose
    features are intermediate hidden states never runs the later ones); their tensors are recognised
    and skipped, and the config says ``layers``."""
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    folder = Path(path)
    if folder.is_file() and folder.suffix == ".safetensors":
        if config is None:
            raise CheckpointError(f"{folder}: a single-file text encoder needs its config given")
    elif not folder.is_dir():
        raise CheckpointError(
            f"{folder}: not a folder or .safetensors file; a decoder-LM text encoder is a transformers "
            "folder (or one safetensors file with its config)"
        )
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
    prefix = _text_prefix(files)
    skipped = _skipped(keys)
    if layers is not None and layers < config.num_hidden_layers:
        later = tuple(f"{prefix}layers.{i}." for i in range(layers, config.num_hidden_layers))
        skipped[f"layers {layers}.."] = [k for k in keys if k.startswith(later)]
        config = dataclasses.replace(config, num_hidden_layers=layers)
    dropped = {k for group in skipped.values() for k in group}
    return DecoderLMCheckpoint(
        Without(files, dropped), config, hf_table(config), prefix, {g: len(v) for g, v in skipped.items()}
    )
