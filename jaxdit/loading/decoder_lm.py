"""A decoder-LM text encoder (``jaxdit.text_encoders.decoder_lm``) from a transformers ``save_pretrained``
folder: ``config.json`` plus ``model.safetensors`` or a sharded ``model.safetensors.index.json``.

The key mapping is strict: every tensor in the files is either consumed or skipped by name (the LM head,
which an encoder never uses, and a vision-language model's vision tower, ``visual.*``); anything else,
a missing tensor or a wrong shape is refused with the tensor's name. Files are read memory-mapped, and
each layer's tensors are stacked on the host before going to the device once.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdit.text_encoders.common import resolve_device
from jaxdit.text_encoders.decoder_lm import DecoderLMConfig, parameter_shapes

__all__ = ["load_decoder_lm", "map_key"]

# Where the decoder sits in the layouts transformers saves: Qwen2.5-VL (current and older), a causal LM,
# and a bare decoder (``Qwen2Model.save_pretrained``: no prefix).
_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")
_SKIPPED = re.compile(r"^(lm_head\.|visual\.|model\.visual\.|language_model\.lm_head\.)")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def map_key(name: str) -> tuple[str, int | None] | None:
    """A checkpoint tensor name -> (parameter name, layer index or None), or None for a tensor skipped by
    name. Whether the parameter exists is the loader's check."""
    if _SKIPPED.match(name):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            rest = name.removeprefix(prefix)
            m = _LAYER.match(rest)
            return (f"layers.{m.group(2)}", int(m.group(1))) if m else (rest, None)
    raise AssertionError("unreachable: the empty prefix matches every name")


def _files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def load_decoder_lm(
    path: str | os.PathLike[str], *, device: jax.Device | None = None, dtype: Any = jnp.float32
) -> tuple[DecoderLMConfig, dict[str, jax.Array]]:
    """(config, parameters on ``device`` in ``dtype``) from a transformers folder."""
    from safetensors import safe_open  # memory-mapped reads

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a transformers save_pretrained folder)")
    cfg = DecoderLMConfig.from_hf_config(folder / "config.json")
    shapes = parameter_shapes(cfg)
    n = cfg.num_hidden_layers
    found: dict[str, dict[int | None, np.ndarray]] = {}
    for file in _files(folder):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                mapped = map_key(name)
                if mapped is None:
                    continue
                key, layer = mapped
                if key not in shapes or (layer is not None and not 0 <= layer < n):
                    raise ValueError(f"{file.name}: tensor {name!r} has no place in this {n}-layer decoder")
                want = shapes[key][1:] if layer is not None else shapes[key]
                array = f.get_tensor(name)
                if tuple(array.shape) != want:
                    raise ValueError(f"{file.name}: tensor {name!r} has shape {array.shape}, expected {want}")
                if layer in found.setdefault(key, {}):
                    raise ValueError(f"tensor {name!r} appears twice")
                found[key][layer] = array
    sharding = jax.sharding.SingleDeviceSharding(resolve_device(device))
    params: dict[str, jax.Array] = {}
    for key in shapes:
        parts = found.get(key, {})
        expected = list(range(n)) if key.startswith("layers.") else [None]
        missing = [i for i in expected if i not in parts]
        if missing:
            where = "" if missing == [None] else f" (layers {missing})"
            raise ValueError(f"{folder}: checkpoint lacks {key}{where}")
        host = np.stack([parts[i] for i in expected]) if expected != [None] else parts[None]
        params[key] = jax.device_put(jnp.asarray(host, dtype=dtype), sharding)
    return cfg, params
