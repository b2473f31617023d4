"""CLIP text and vision checkpoints -> jaxdit parameters (``jaxdit/text_encoders/clip.py``).

Layout: a transformers ``CLIPTextModel`` / ``CLIPVisionModel`` folder, ``config.json`` + safetensors
(single or sharded with an index), e.g. FLUX's ``text_encoder/`` and Wan I2V's ``image_encoder/``. Files
written by transformers 4 prefix every key with ``text_model.`` / ``vision_model.``; transformers 5 writes
them without; both are read. Older files also hold the ``embeddings.position_ids`` buffer: it must be
``arange(positions)`` and is then consumed. A folder whose config declares ``CLIPTextModelWithProjection``
/ ``CLIPVisionModelWithProjection`` also holds the projection head, which these encoders do not use: its
shape is checked and it is consumed.

Hooks: linear weights are transposed to [in, out] kernels; the patch convolution's weight [E, C, p, p] is
permuted to the matmul kernel [C, p, p, E] (:func:`patch_conv`). Every source key is consumed; a missing,
extra or mis-shaped tensor raises :class:`CheckpointError` naming the key and the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from converters.errors import CheckpointError
from converters.keymap import (
    IDENTITY,
    TRANSPOSE,
    Hook,
    KeyRule,
    KeyTable,
    StateDict,
    Without,
    file_of,
    invert,
    resolve,
)
from converters.safetensors_io import LazyTensor, open_checkpoint, transpose
from jaxdit.text_encoders.clip import CLIPTextConfig, CLIPVisionConfig

__all__ = [
    "ClipCheckpoint",
    "Permute",
    "open_clip_text",
    "open_clip_vision",
    "patch_conv",
    "text_table",
    "vision_table",
]

BLOCKS = "blocks"
TEXT_PREFIX, VISION_PREFIX = "text_model.", "vision_model."
POSITION_IDS = "embeddings.position_ids"


@dataclasses.dataclass(frozen=True)
class Permute(Hook):
    """``np.transpose(source, axes)``: e.g. a convolution weight as a matmul kernel."""

    axes: tuple[int, ...]
    label: str = "permute"
    name: ClassVar[str] = "permute"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        src = sources[0]
        if src.ndim != len(self.axes):
            raise ValueError(f"{self.label} expects a {len(self.axes)}-D tensor")
        return transpose(src, self.axes)

    def invert(self, target: np.ndarray) -> list[tuple[int, tuple[tuple[int, int], ...], np.ndarray]]:
        src = np.ascontiguousarray(np.transpose(target, np.argsort(self.axes)))
        return [(0, tuple((0, d) for d in src.shape), src)]

    def describe(self) -> str:
        return f"{self.label} {self.axes}"


def patch_conv() -> Permute:
    """The stride-p patch convolution's weight [E, C, p, p] as the kernel [C, p, p, E]."""
    return Permute((1, 2, 3, 0), label="patch_conv")


def _layers(prefix: str) -> list[KeyRule]:
    src = f"{prefix}encoder.layers.{{i}}"
    rules = []
    for norm in ("layer_norm1", "layer_norm2"):
        rules.append(KeyRule(f"{BLOCKS}.{norm}.scale", f"{src}.{norm}.weight", IDENTITY, BLOCKS))
        rules.append(KeyRule(f"{BLOCKS}.{norm}.bias", f"{src}.{norm}.bias", IDENTITY, BLOCKS))
    for name, source in (
        ("q_proj", "self_attn.q_proj"),
        ("k_proj", "self_attn.k_proj"),
        ("v_proj", "self_attn.v_proj"),
        ("out_proj", "self_attn.out_proj"),
        ("fc1", "mlp.fc1"),
        ("fc2", "mlp.fc2"),
    ):
        rules.append(KeyRule(f"{BLOCKS}.{name}.kernel", f"{src}.{source}.weight", TRANSPOSE, BLOCKS))
        rules.append(KeyRule(f"{BLOCKS}.{name}.bias", f"{src}.{source}.bias", IDENTITY, BLOCKS))
    return rules


def _norm(target: str, source: str) -> list[KeyRule]:
    return [KeyRule(f"{target}.scale", f"{source}.weight"), KeyRule(f"{target}.bias", f"{source}.bias")]


def text_table(cfg: CLIPTextConfig, prefix: str = "") -> KeyTable:
    """transformers ``CLIPTextModel`` state dict (keys after ``prefix``) -> jaxdit parameters."""
    p = prefix
    rules = [
        KeyRule("token_embedding", f"{p}embeddings.token_embedding.weight"),
        KeyRule("position_embedding", f"{p}embeddings.position_embedding.weight"),
        *_layers(p),
        *_norm("final_layer_norm", f"{p}final_layer_norm"),
    ]
    return KeyTable("CLIP text transformers", tuple(rules), {BLOCKS: cfg.num_hidden_layers})


def vision_table(cfg: CLIPVisionConfig, prefix: str = "") -> KeyTable:
    """transformers ``CLIPVisionModel`` state dict (keys after ``prefix``) -> jaxdit parameters."""
    p = prefix
    rules = [
        KeyRule("class_embedding", f"{p}embeddings.class_embedding"),
        KeyRule("patch_embedding", f"{p}embeddings.patch_embedding.weight", patch_conv()),
        KeyRule("position_embedding", f"{p}embeddings.position_embedding.weight"),
        *_norm("pre_layrnorm", f"{p}pre_layrnorm"),
        *_layers(p),
        *_norm("post_layernorm", f"{p}post_layernorm"),
    ]
    return KeyTable("CLIP vision transformers", tuple(rules), {BLOCKS: cfg.num_hidden_layers})


# --------------------------------------------------------------------------------------------------------
# Opening
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ClipCheckpoint:
    """An opened CLIP text or vision checkpoint: tensors, key prefix, config and table."""

    ckpt: Any
    prefix: str
    config: CLIPTextConfig | CLIPVisionConfig
    table: KeyTable

    @property
    def dtype(self) -> np.dtype:
        key = next(r.sources[0] for r in self.table.rules if r.target == "position_embedding")
        return np.dtype(self.ckpt.tensor(key).dtype)

    def resolve(self, expected: Mapping[str, tuple[int, ...]]) -> dict[str, LazyTensor]:
        return resolve(self.table, self.ckpt, expected)


def _check_position_ids(ckpt: Any, key: str) -> None:
    """The persistent ``position_ids`` buffer of older files: [1, P] (or [P]) holding 0..P-1."""
    t = ckpt.tensor(key)
    values = np.asarray(t[tuple(slice(0, d) for d in t.shape)]).reshape(-1)
    if not np.array_equal(values, np.arange(values.size)):
        raise CheckpointError(
            f"{file_of(ckpt, key)}: buffer {key!r} is not 0..{values.size - 1}; CLIP's position ids are fixed"
        )


def _projection_head(folder: Path, what: str) -> str | None:
    """The projection weight a ``CLIP*ModelWithProjection`` checkpoint adds, if its config declares that
    class: the encoders here return hidden states and the pooled output before it, so it is consumed
    unused (only its shape is checked). Any other stray tensor is still an error."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        return None
    try:
        architectures = json.loads(cfg_path.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: cannot read the config: {e}") from e
    head = {"CLIPTextModel": "text_projection.weight", "CLIPVisionModel": "visual_projection.weight"}[what]
    return head if f"{what}WithProjection" in architectures else None


def _open(
    path: str | os.PathLike[str], config: Any, prefix: str, make_config: Any, make_table: Any, what: str
) -> ClipCheckpoint:
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"{folder}: no such file or folder")
    if config is None:
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"{folder}: no config.json (expected a transformers {what} folder)")
        try:
            config = make_config(folder / "config.json")
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    files = open_checkpoint(folder)
    keys = list(files.keys())
    use = prefix if any(k.startswith(prefix) for k in keys) else ""
    unused: set[str] = set()
    if use + POSITION_IDS in keys:
        _check_position_ids(files, use + POSITION_IDS)
        unused.add(use + POSITION_IDS)
    head = _projection_head(folder, what)
    if head is not None and head in keys:
        shape = tuple(files.shape(head))
        if len(shape) != 2 or shape[1] != config.hidden_size:
            raise CheckpointError(
                f"{files.file_of(head)}: tensor {head!r} has shape {shape}; a projection of the "
                f"{config.hidden_size}-wide pooled output should be [projection_dim, {config.hidden_size}]"
            )
        unused.add(head)
    ckpt: Any = Without(files, unused) if unused else files
    return ClipCheckpoint(ckpt, use, config, make_table(config, use))


def open_clip_text(path: str | os.PathLike[str], config: CLIPTextConfig | None = None) -> ClipCheckpoint:
    """Open a transformers ``CLIPTextModel`` folder (FLUX's ``text_encoder/``)."""
    return _open(path, config, TEXT_PREFIX, CLIPTextConfig.from_hf_config, text_table, "CLIPTextModel")


def open_clip_vision(path: str | os.PathLike[str], config: CLIPVisionConfig | None = None) -> ClipCheckpoint:
    """Open a transformers ``CLIPVisionModel`` folder (Wan I2V's ``image_encoder/``)."""
    return _open(
        path, config, VISION_PREFIX, CLIPVisionConfig.from_hf_config, vision_table, "CLIPVisionModel"
    )


def state_dict_to_params(
    table: KeyTable, state_dict: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]]
):
    """A state dict (numpy-convertible values) -> jaxdit parameter arrays by path (tests)."""
    lazies = resolve(table, StateDict(state_dict), expected)
    return {path: np.asarray(t) for path, t in lazies.items()}


def params_to_state_dict(table: KeyTable, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """jaxdit parameters -> the table's source state dict (tests write other prefixes this way)."""
    return invert(table, params)
