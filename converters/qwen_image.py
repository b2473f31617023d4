"""Qwen-Image transformer checkpoints -> jaxdit parameters (``jaxdit/models/qwen_image.py``).

Layouts:

- diffusers ``QwenImageTransformer2DModel``: a ``transformer/`` folder (``config.json`` + safetensors,
  sharded with ``diffusion_pytorch_model.safetensors.index.json`` as Qwen/Qwen-Image ships it), or the
  pipeline folder holding it;
- ComfyUI's single file: the same keys under ``model.diffusion_model.`` or ``diffusion_model.`` (or none),
  its config inferred from the shapes (the RoPE split is Qwen-Image's (16, 56, 56) for head_dim 128).

jaxdit's parameters keep diffusers' names, so the table is one rule per tensor (torch ``Linear`` weights
transposed to [in, out] kernels); every source key is consumed and a missing, extra or mis-shaped tensor
is a :class:`CheckpointError` naming the key and the file (``converters/keymap.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from converters.checkpoints import CheckpointFormat
from converters.errors import CheckpointError
from converters.keymap import IDENTITY, TRANSPOSE, KeyRule, KeyTable, StateDict, resolve, where
from converters.safetensors_io import CheckpointFiles, open_checkpoint
from jaxdit.models.qwen_image import abstract_model
from jaxdit.models.qwen_image_config import QwenImageConfig

__all__ = [
    "CHECKPOINTS",
    "COMFY_PREFIXES",
    "QwenImageCheckpoint",
    "detect",
    "diffusers_table",
    "diffusers_to_params",
]

DIFFUSERS_CLASS = "QwenImageTransformer2DModel"
#: ComfyUI single files put every diffusers key under one of these.
COMFY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
BLOCKS = "transformer_blocks"


def _linear(target: str, source: str, stack: str | None = None) -> list[KeyRule]:
    return [
        KeyRule(f"{target}.kernel", f"{source}.weight", TRANSPOSE, stack),
        KeyRule(f"{target}.bias", f"{source}.bias", IDENTITY, stack),
    ]


def diffusers_table(cfg: QwenImageConfig) -> KeyTable:
    """diffusers ``QwenImageTransformer2DModel`` state dict -> jaxdit parameters."""
    rules = _linear("time_embed.linear_1", "time_text_embed.timestep_embedder.linear_1")
    rules += _linear("time_embed.linear_2", "time_text_embed.timestep_embedder.linear_2")
    rules.append(KeyRule("txt_norm", "txt_norm.weight"))
    rules += _linear("img_in", "img_in") + _linear("txt_in", "txt_in")
    blk = f"{BLOCKS}.{{i}}"
    for stream in ("img", "txt"):
        # nn.Sequential(SiLU, Linear): the Linear is entry 1.
        rules += _linear(f"{BLOCKS}.{stream}_mod", f"{blk}.{stream}_mod.1", BLOCKS)
        rules += _linear(f"{BLOCKS}.{stream}_mlp.proj", f"{blk}.{stream}_mlp.net.0.proj", BLOCKS)
        rules += _linear(f"{BLOCKS}.{stream}_mlp.out", f"{blk}.{stream}_mlp.net.2", BLOCKS)
    for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
        rules += _linear(f"{BLOCKS}.{name}", f"{blk}.attn.{name}", BLOCKS)
    rules += _linear(f"{BLOCKS}.to_out", f"{blk}.attn.to_out.0", BLOCKS)
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        rules.append(KeyRule(f"{BLOCKS}.{name}", f"{blk}.attn.{name}.weight", IDENTITY, BLOCKS))
    # AdaLayerNormContinuous: (scale, shift), the order the model splits it in; no swap.
    rules += _linear("norm_out", "norm_out.linear") + _linear("proj_out", "proj_out")
    if cfg.num_layers == 0:
        rules = [r for r in rules if r.stack is None]
    return KeyTable("Qwen-Image diffusers", tuple(rules), {BLOCKS: cfg.num_layers})


@dataclasses.dataclass
class QwenImageCheckpoint:
    """An opened Qwen-Image transformer checkpoint: its files, key prefix and config."""

    files: CheckpointFiles
    prefix: str
    config: QwenImageConfig

    @property
    def table(self) -> KeyTable:
        return diffusers_table(self.config)

    @property
    def dtype(self) -> np.dtype:
        return self.files.dtype(self.prefix + "img_in.weight")

    def resolve(self, expected: Mapping[str, tuple[int, ...]]):
        return resolve(self.table, self.files, expected, prefix=self.prefix)


def _diffusers_folder(path: Path) -> Path | None:
    """The folder holding a diffusers Qwen-Image transformer: ``path`` or a pipeline's ``transformer/``."""
    for folder in (path, path / "transformer"):
        cfg = folder / "config.json"
        if cfg.is_file():
            try:
                data = json.loads(cfg.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{cfg}: cannot read the config: {e}") from e
            if data.get("_class_name") == DIFFUSERS_CLASS:
                return folder
    return None


def config_from_shapes(shapes: Mapping[str, tuple[int, ...]]) -> QwenImageConfig:
    """A single file without its config.json: the config from the tensors' shapes (diffusers keys)."""
    hidden, in_channels = shapes["img_in.weight"]
    head_dim = (
        shapes[f"{BLOCKS}.0.attn.norm_q.weight"][0] if f"{BLOCKS}.0.attn.norm_q.weight" in shapes else 128
    )
    layers = {int(k.split(".")[1]) for k in shapes if k.startswith(BLOCKS + ".")}
    if head_dim != 128:
        raise CheckpointError(f"head_dim {head_dim}: pass the config (the RoPE split is not in the weights)")
    out_features = shapes["proj_out.weight"][0]
    return QwenImageConfig(
        in_channels=in_channels,
        out_channels=out_features // 4,  # patch_size 2: four latent pixels per token
        num_layers=max(layers) + 1 if layers else 0,
        attention_head_dim=head_dim,
        num_attention_heads=hidden // head_dim,
        joint_attention_dim=shapes["txt_in.weight"][1],
    )


def is_qwen_image_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` looks like a Qwen-Image transformer (cheap: config or header keys only)."""
    path = Path(path)
    if path.is_dir():
        if _diffusers_folder(path) is not None:
            return True
        if (path / "config.json").is_file():
            return False
    try:
        keys = set(open_checkpoint(path).keys())
    except CheckpointError:
        return False
    return any(p + "txt_norm.weight" in keys and p + "img_in.weight" in keys for p in COMFY_PREFIXES + ("",))


def detect(
    path: str | os.PathLike[str], config: QwenImageConfig | Mapping[str, Any] | None = None
) -> QwenImageCheckpoint:
    """Open a Qwen-Image transformer checkpoint of any supported layout and work out its config
    (``config``, a ``QwenImageConfig`` or a diffusers config dict, overrides it; shapes are still checked)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if isinstance(config, Mapping):
        config = QwenImageConfig.from_diffusers(config)
    folder = _diffusers_folder(path) if path.is_dir() else None
    if folder is not None:
        try:
            cfg = config or QwenImageConfig.from_diffusers(folder / "config.json")
        except ValueError as e:
            raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
        return QwenImageCheckpoint(open_checkpoint(folder), "", cfg)
    files = open_checkpoint(path)
    keys = set(files.keys())
    for prefix in COMFY_PREFIXES + ("",):
        if prefix + "txt_norm.weight" in keys and prefix + "img_in.weight" in keys:
            if config is None:
                n = len(prefix)
                try:
                    config = config_from_shapes({k[n:]: files.shape(k) for k in keys if k.startswith(prefix)})
                except KeyError as e:
                    raise CheckpointError(
                        f"{where(files)}: cannot infer the Qwen-Image config, no tensor {e}"
                    ) from None
            return QwenImageCheckpoint(files, prefix, config)
    raise CheckpointError(
        f"{where(files)}: not a Qwen-Image transformer (no 'txt_norm.weight' and 'img_in.weight', bare or "
        f"under {' / '.join(COMFY_PREFIXES)}; expected a diffusers {DIFFUSERS_CLASS} folder or a ComfyUI file)"
    )


def diffusers_to_params(cfg: QwenImageConfig, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A diffusers state dict (numpy-convertible values) -> jaxdit parameter arrays, by path."""
    from jaxdit.models.qwen_image import parameter_shapes

    lazies = resolve(diffusers_table(cfg), StateDict(state_dict), parameter_shapes(cfg))
    return {p: np.asarray(t) for p, t in lazies.items()}


#: Qwen-Image transformer checkpoints as ``jaxdit.loading.params.load_params`` reads them.
CHECKPOINTS = CheckpointFormat(
    name="qwen-image",
    detect=is_qwen_image_checkpoint,
    open=detect,
    config_class=QwenImageConfig,
    abstract_model=abstract_model,
)
