"""The toy family's checkpoints: a folder of ``config.json`` (``_class_name: ToyDiT``) and one
safetensors file in the toy's own key names (PyTorch-style ``[out, in]`` weights, so the table transposes
them), read through ``converters.keymap`` like FLUX's and Wan's tables, and written from parameters
through the same table inverted (:func:`write_folder`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from converters.checkpoints import CheckpointFormat
from converters.errors import CheckpointError
from converters.keymap import IDENTITY, TRANSPOSE, KeyRule, KeyTable, invert, resolve
from converters.safetensors_io import CheckpointFiles, open_checkpoint, write_safetensors
from jaxdit.models.partitioning import parameter_shapes

from .model import ToyConfig, abstract_model

CLASS_NAME = "ToyDiT"
WEIGHTS = "toy_model.safetensors"

#: jaxdit parameter (without .kernel / .bias) -> the toy checkpoint's key (without .weight / .bias).
LINEARS = {
    "x_in": "embed.latent",
    "txt_in": "embed.text",
    "t_in": "embed.time.0",
    "t_out": "embed.time.2",
    "out_mod": "head.adaln",
    "out": "head.proj",
}
BLOCK_LINEARS = {
    "modulation": "adaln",
    "q": "attn.wq",
    "k": "attn.wk",
    "v": "attn.wv",
    "proj": "attn.wo",
    "fc1": "mlp.up",
    "fc2": "mlp.down",
}


def key_table(cfg: ToyConfig) -> KeyTable:
    """The toy checkpoint's keys -> jaxdit's parameters."""
    rules = []
    for target, source in LINEARS.items():
        rules.append(KeyRule(f"{target}.kernel", f"{source}.weight", TRANSPOSE))
        rules.append(KeyRule(f"{target}.bias", f"{source}.bias", IDENTITY))
    for target, source in BLOCK_LINEARS.items():
        rules.append(KeyRule(f"blocks.{target}.kernel", f"layers.{{i}}.{source}.weight", TRANSPOSE, "blocks"))
        rules.append(KeyRule(f"blocks.{target}.bias", f"layers.{{i}}.{source}.bias", IDENTITY, "blocks"))
    return KeyTable("toy", tuple(rules), {"blocks": cfg.depth})


@dataclasses.dataclass
class ToyCheckpoint:
    files: CheckpointFiles
    config: ToyConfig

    @property
    def dtype(self) -> np.dtype:
        return self.files.dtype("embed.latent.weight")

    def resolve(self, expected: Mapping[str, tuple[int, ...]]):
        return resolve(key_table(self.config), self.files, expected)


def _config_file(path: Path) -> Path | None:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg}: cannot read the config: {e}") from e
    return cfg if data.get("_class_name") == CLASS_NAME else None


def detect(path: Path) -> bool:
    """A toy checkpoint is a folder whose config.json says ``ToyDiT`` (cheap: the config only)."""
    return Path(path).is_dir() and _config_file(path) is not None


def open_toy(path: Path, config: ToyConfig | None = None) -> ToyCheckpoint:
    path = Path(path)
    cfg_file = _config_file(path) if path.is_dir() else None
    if cfg_file is None:
        raise CheckpointError(f"{path}: not a toy checkpoint (no config.json with _class_name {CLASS_NAME})")
    if config is None:
        config = ToyConfig.from_json(json.loads(cfg_file.read_text(encoding="utf-8")))
    return ToyCheckpoint(open_checkpoint(path), config)


def write_folder(path: Path, config: ToyConfig, params: Mapping[str, Any]) -> Path:
    """``params`` (dotted parameter path -> array, stacked blocks with their layer axis) as a toy folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / WEIGHTS, invert(key_table(config), params))
    (path / "config.json").write_text(json.dumps({"_class_name": CLASS_NAME, **config.to_json()}))
    return path


def random_params(config: ToyConfig, seed: int = 0, scale: float = 0.15) -> dict[str, np.ndarray]:
    """Random fp32 parameters of every shape the model has (biases and gates nonzero, so every path of
    the forward matters)."""
    rng = np.random.default_rng(seed)
    shapes = parameter_shapes(abstract_model(config))
    return {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in sorted(shapes.items())}


#: What ``jaxdit.loading`` and the family registry read toy checkpoints through.
CHECKPOINTS = CheckpointFormat(
    name="toy",
    detect=detect,
    open=open_toy,
    config_class=ToyConfig,
    abstract_model=abstract_model,
)
