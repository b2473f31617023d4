"""T5 v1.1 / umT5 encoder checkpoints -> jaxdit parameters (``jaxdit/text_encoders/t5.py``).

Layouts:

- transformers ``T5EncoderModel`` / ``UMT5EncoderModel`` folder: ``config.json`` + ``model.safetensors``
  or shards with ``model.safetensors.index.json`` (a diffusers pipeline's ``text_encoder_2/`` for FLUX,
  ``text_encoder/`` for Wan). The token embedding is tied: a file may hold ``shared.weight``,
  ``encoder.embed_tokens.weight`` or both. With both, the second must be the same tensor (same shape,
  and equal on a sample of rows); it is then consumed as an alias.
- Wan 2.1's original ``models_t5_umt5-xxl-enc-bf16.pth`` (``wan/modules/t5.py`` ``T5Encoder``):
  ``token_embedding.weight``, ``blocks.N.{norm1,norm2}.weight``, ``blocks.N.attn.{q,k,v,o}.weight``,
  ``blocks.N.ffn.gate.0.weight`` (the GELU branch, HF ``wi_0``), ``blocks.N.ffn.fc1.weight`` (the linear
  branch, ``wi_1``), ``blocks.N.ffn.fc2.weight`` (``wo``), ``blocks.N.pos_embedding.embedding.weight``
  (one per layer: umT5) and ``norm.weight``. It is a torch zip file, read only with
  ``torch.load(map_location="cpu", weights_only=True, mmap=True)``: nothing but tensors is unpickled, and
  the bytes stay memory-mapped until a device reads them. The config is inferred from the shapes.

Every source key is consumed; a missing, extra or mis-shaped tensor raises :class:`CheckpointError` naming
the key and the file (``converters/keymap.py``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import CheckpointError
from converters.keymap import (
    IDENTITY,
    TRANSPOSE,
    KeyRule,
    KeyTable,
    StateDict,
    Without,
    file_of,
    invert,
    resolve,
    where,
)
from converters.pth_io import read_pth
from converters.safetensors_io import LazyTensor, open_checkpoint
from jaxdit.text_encoders.t5 import T5Config

__all__ = [
    "WAN_T5_FILE",
    "T5Checkpoint",
    "hf_table",
    "hf_to_params",
    "load_pth",
    "open_t5",
    "wan_table",
    "write_wan_original",
]

#: The umT5 encoder file of Wan 2.1's original release.
WAN_T5_FILE = "models_t5_umt5-xxl-enc-bf16.pth"
#: transformers' tied input embedding: the encoder's copy of ``shared.weight``.
HF_EMBED, HF_EMBED_ALIAS = "shared.weight", "encoder.embed_tokens.weight"
#: Rows compared when a checkpoint holds both tied embedding keys.
_TIE_SAMPLE_ROWS = 16

BLOCKS = "blocks"


# --------------------------------------------------------------------------------------------------------
# A checkpoint seen without some keys (tied aliases and buffers checked, then consumed); also used by
# converters/clip.py
# --------------------------------------------------------------------------------------------------------


def check_alias(ckpt: Any, key: str, alias: str) -> None:
    """``alias`` must hold the same tensor as ``key`` (same shape and dtype, equal on sampled rows)."""
    a, b = ckpt.tensor(key), ckpt.tensor(alias)
    if tuple(a.shape) != tuple(b.shape) or np.dtype(a.dtype) != np.dtype(b.dtype):
        raise CheckpointError(
            f"{file_of(ckpt, alias)}: tensor {alias!r} ({b.shape}, {b.dtype}) should be tied to {key!r} "
            f"({a.shape}, {a.dtype})"
        )
    rows = np.unique(np.linspace(0, a.shape[0] - 1, min(_TIE_SAMPLE_ROWS, a.shape[0])).astype(int))
    rest = tuple(slice(0, d) for d in a.shape[1:])
    for r in rows:
        if not np.array_equal(a[(slice(int(r), int(r) + 1),) + rest], b[(slice(int(r), int(r) + 1),) + rest]):
            raise CheckpointError(
                f"{file_of(ckpt, alias)}: tensor {alias!r} differs from {key!r} in row {r}; the two are tied "
                "in T5 (one embedding), so the checkpoint is inconsistent"
            )


# --------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------


def _stacked(target: str, source: str, hook=IDENTITY) -> KeyRule:
    return KeyRule(f"{BLOCKS}.{target}", source, hook, BLOCKS)


def hf_table(cfg: T5Config, embed_key: str = HF_EMBED) -> KeyTable:
    """transformers ``T5EncoderModel``/``UMT5EncoderModel`` state dict -> jaxdit parameters."""
    blk = "encoder.block.{i}.layer"
    rules = [KeyRule("embed", embed_key)]
    bias = "SelfAttention.relative_attention_bias.weight"
    if cfg.per_layer_position_bias:
        rules.append(_stacked("relative_attention_bias", f"{blk}.0.{bias}"))
    else:
        rules.append(KeyRule("relative_attention_bias", f"encoder.block.0.layer.0.{bias}"))
    rules.append(_stacked("attn_norm", f"{blk}.0.layer_norm.weight"))
    for name in ("q", "k", "v", "o"):
        rules.append(_stacked(f"{name}.kernel", f"{blk}.0.SelfAttention.{name}.weight", TRANSPOSE))
    rules.append(_stacked("ffn_norm", f"{blk}.1.layer_norm.weight"))
    for name in ("wi_0", "wi_1", "wo"):
        rules.append(_stacked(f"{name}.kernel", f"{blk}.1.DenseReluDense.{name}.weight", TRANSPOSE))
    rules.append(KeyRule("final_norm", "encoder.final_layer_norm.weight"))
    name = "umT5 transformers" if cfg.per_layer_position_bias else "T5 transformers"
    return KeyTable(name, tuple(rules), {BLOCKS: cfg.num_layers})


def wan_table(cfg: T5Config) -> KeyTable:
    """Wan 2.1's original ``T5Encoder`` state dict -> jaxdit parameters."""
    blk = "blocks.{i}"
    rules = [KeyRule("embed", "token_embedding.weight")]
    if cfg.per_layer_position_bias:
        rules.append(_stacked("relative_attention_bias", f"{blk}.pos_embedding.embedding.weight"))
    else:
        rules.append(KeyRule("relative_attention_bias", "pos_embedding.embedding.weight"))
    rules.append(_stacked("attn_norm", f"{blk}.norm1.weight"))
    for name in ("q", "k", "v", "o"):
        rules.append(_stacked(f"{name}.kernel", f"{blk}.attn.{name}.weight", TRANSPOSE))
    rules.append(_stacked("ffn_norm", f"{blk}.norm2.weight"))
    # Wan's FFN is fc1(x) * gate(x) with the GELU in `gate`: gate = HF wi_0, fc1 = wi_1, fc2 = wo.
    for name, src in (("wi_0", "gate.0"), ("wi_1", "fc1"), ("wo", "fc2")):
        rules.append(_stacked(f"{name}.kernel", f"{blk}.ffn.{src}.weight", TRANSPOSE))
    rules.append(KeyRule("final_norm", "norm.weight"))
    return KeyTable("umT5 Wan original", tuple(rules), {BLOCKS: cfg.num_layers})


# --------------------------------------------------------------------------------------------------------
# Reading .pth files
# --------------------------------------------------------------------------------------------------------


def load_pth(path: str | os.PathLike[str]) -> StateDict:
    """Wan's umT5 ``.pth`` as a :class:`StateDict` (weights-only; :mod:`converters.pth_io`)."""
    return read_pth(path)


def _count(keys: set[str], prefix: str) -> int:
    idx = {int(k[len(prefix) :].split(".", 1)[0]) for k in keys if k.startswith(prefix)}
    return max(idx) + 1 if idx else 0


def config_from_wan_keys(ckpt: Any) -> T5Config:
    """The encoder config from a Wan ``T5Encoder`` state dict's shapes (the bucket distance is not stored;
    Wan's ``T5RelativeEmbedding`` fixes it at 128, the T5 default kept here)."""
    keys = set(ckpt)

    def shape(key: str) -> tuple[int, ...]:
        if key not in keys:
            raise CheckpointError(f"{where(ckpt)}: cannot infer the umT5 config, no tensor {key!r}")
        return tuple(ckpt.tensor(key).shape)

    vocab, dim = shape("token_embedding.weight")
    per_layer = "blocks.0.pos_embedding.embedding.weight" in keys
    buckets, num_heads = shape(
        "blocks.0.pos_embedding.embedding.weight" if per_layer else "pos_embedding.embedding.weight"
    )
    inner = shape("blocks.0.attn.q.weight")[0]
    if inner % num_heads:
        raise CheckpointError(
            f"{where(ckpt)}: attention width {inner} is not a multiple of {num_heads} heads"
        )
    return T5Config(
        vocab_size=vocab,
        d_model=dim,
        d_kv=inner // num_heads,
        d_ff=shape("blocks.0.ffn.fc1.weight")[0],
        num_layers=_count(keys, "blocks."),
        num_heads=num_heads,
        relative_attention_num_buckets=buckets,
        per_layer_position_bias=per_layer,
    )


# --------------------------------------------------------------------------------------------------------
# Opening
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class T5Checkpoint:
    """An opened T5/umT5 encoder checkpoint: the tensors, their layout, the config and the table."""

    ckpt: Any
    layout: str  # "hf" or "wan"
    config: T5Config
    table: KeyTable

    @property
    def dtype(self) -> np.dtype:
        key = self.table.rules[0].sources[0]  # the embedding
        return np.dtype(self.ckpt.tensor(key).dtype)

    def resolve(self, expected: Mapping[str, tuple[int, ...]]) -> dict[str, LazyTensor]:
        return resolve(self.table, self.ckpt, expected)


def _open_hf(folder: Path, config: T5Config | None) -> T5Checkpoint:
    if config is None:
        try:
            config = T5Config.from_hf_config(folder / "config.json")
        except (ValueError, KeyError, OSError) as e:
            raise CheckpointError(f"{folder / 'config.json'}: not a T5 encoder config: {e}") from None
    cfg = config
    files = open_checkpoint(folder)
    keys = set(files.keys())
    if HF_EMBED in keys and HF_EMBED_ALIAS in keys:
        check_alias(files, HF_EMBED, HF_EMBED_ALIAS)
        return T5Checkpoint(Without(files, {HF_EMBED_ALIAS}), "hf", cfg, hf_table(cfg, HF_EMBED))
    embed = HF_EMBED_ALIAS if HF_EMBED_ALIAS in keys else HF_EMBED
    return T5Checkpoint(files, "hf", cfg, hf_table(cfg, embed))


def _open_wan(path: Path, config: T5Config | None) -> T5Checkpoint:
    ckpt = load_pth(path)
    cfg = config or config_from_wan_keys(ckpt)
    return T5Checkpoint(ckpt, "wan", cfg, wan_table(cfg))


def open_t5(path: str | os.PathLike[str], config: T5Config | None = None) -> T5Checkpoint:
    """Open a T5/umT5 encoder checkpoint: a transformers folder (``config.json`` + safetensors), Wan's
    ``.pth`` file, or a Wan folder holding ``models_t5_umt5-xxl-enc-bf16.pth``. ``config`` overrides the
    one read or inferred (its shapes are still checked against every tensor)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file():
        if path.suffix in (".pth", ".pt", ".bin"):
            return _open_wan(path, config)
        raise CheckpointError(
            f"{path}: a T5 encoder is a transformers folder (config.json + safetensors) or Wan's {WAN_T5_FILE}"
        )
    if (path / "config.json").is_file():
        return _open_hf(path, config)
    if (path / WAN_T5_FILE).is_file():
        return _open_wan(path / WAN_T5_FILE, config)
    raise CheckpointError(
        f"{path}: no config.json (transformers T5EncoderModel/UMT5EncoderModel folder) and no {WAN_T5_FILE}"
    )


# --------------------------------------------------------------------------------------------------------
# Export (tests write Wan's layout from a transformers model this way)
# --------------------------------------------------------------------------------------------------------


def hf_to_params(cfg: T5Config, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A transformers state dict (numpy-convertible values) -> jaxdit parameter arrays by path."""
    from jaxdit.text_encoders.common import parameter_shapes
    from jaxdit.text_encoders.t5 import abstract_model

    sd = {k: np.asarray(v) for k, v in state_dict.items()}
    ckpt: Any = StateDict(sd)
    embed = HF_EMBED if HF_EMBED in sd else HF_EMBED_ALIAS
    if HF_EMBED in sd and HF_EMBED_ALIAS in sd:
        check_alias(ckpt, HF_EMBED, HF_EMBED_ALIAS)
        ckpt = Without(ckpt, {HF_EMBED_ALIAS})
    lazies = resolve(hf_table(cfg, embed), ckpt, parameter_shapes(abstract_model(cfg)))
    return {path: np.asarray(t) for path, t in lazies.items()}


def write_wan_original(cfg: T5Config, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """jaxdit parameters -> Wan's ``T5Encoder`` state dict (numpy), through the inverted Wan table."""
    return invert(wan_table(cfg), params)
