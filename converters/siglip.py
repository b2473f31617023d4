"""SigLIP vision checkpoints -> jaxdit parameters (``jaxdit/text_encoders/siglip.py``).

Layout: a transformers ``SiglipVisionModel`` folder, ``config.json`` + safetensors (single or sharded),
e.g. HunyuanVideo 1.5 I2V's ``image_encoder/``. transformers 5 writes the keys bare; older files prefix
them with ``vision_model.``: both are read. The encoder layers have CLIP's names (``converters/clip.py``'s
rules). The attention-pooling head (``head.*``, present when ``vision_use_head``) feeds only
``pooler_output``, which no pipeline here reads: its tensors are consumed unused. Every other source key
must be mapped; a missing, extra or mis-shaped tensor raises :class:`CheckpointError`.
"""

from __future__ import annotations

import os
from pathlib import Path

from converters.clip import BLOCKS, ClipCheckpoint, _layers, patch_conv
from converters.errors import CheckpointError
from converters.keymap import KeyRule, KeyTable, Without
from converters.safetensors_io import open_checkpoint
from jaxdit.text_encoders.siglip import SiglipVisionConfig

__all__ = ["open_siglip_vision", "vision_table"]

PREFIX, HEAD = "vision_model.", "head."


def vision_table(cfg: SiglipVisionConfig, prefix: str = "") -> KeyTable:
    """transformers ``SiglipVisionModel`` state dict (keys after ``prefix``) -> jaxdit parameters."""
    p = prefix
    rules = [
        KeyRule("patch_embedding", f"{p}embeddings.patch_embedding.weight", patch_conv()),
        KeyRule("patch_bias", f"{p}embeddings.patch_embedding.bias"),
        KeyRule("position_embedding", f"{p}embeddings.position_embedding.weight"),
        *_layers(p),
        KeyRule("post_layernorm.scale", f"{p}post_layernorm.weight"),
        KeyRule("post_layernorm.bias", f"{p}post_layernorm.bias"),
    ]
    return KeyTable("SigLIP vision transformers", tuple(rules), {BLOCKS: cfg.num_hidden_layers})


def open_siglip_vision(
    path: str | os.PathLike[str], config: SiglipVisionConfig | None = None
) -> ClipCheckpoint:
    """Open a transformers ``SiglipVisionModel`` folder (HunyuanVideo 1.5 I2V's ``image_encoder/``)."""
    folder = Path(path)
    if not (folder / "config.json").is_file() and config is None:
        raise CheckpointError(f"{folder}: no config.json (expected a transformers SiglipVisionModel folder)")
    if config is None:
        try:
            config = SiglipVisionConfig.from_hf_config(folder / "config.json")
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    files = open_checkpoint(folder)
    keys = list(files.keys())
    use = PREFIX if any(k.startswith(PREFIX) for k in keys) else ""
    head = {k for k in keys if k.startswith(use + HEAD)}
    ckpt = Without(files, head) if head else files
    return ClipCheckpoint(ckpt, use, config, vision_table(config, use))
