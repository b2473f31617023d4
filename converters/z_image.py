"""Z-Image transformer checkpoints -> jaxdit parameters (``jaxdit/models/z_image.py``).

Layouts:

- diffusers ``ZImageTransformer2DModel``: a ``transformer/`` folder (``config.json`` + safetensors,
  sharded with an index as Tongyi-MAI ships it) or the pipeline folder holding it; a single file of the
  same keys;
- the original single file (Tongyi-MAI's, as ComfyUI loads it; bare or under ``model.diffusion_model.``
  / ``diffusion_model.``): fused ``attention.qkv``, ``attention.out``, ``q_norm`` / ``k_norm``,
  ``x_embedder`` / ``final_layer`` without diffusers' patch-size key, and an unused ``norm_final`` (as
  diffusers' ``convert_z_image_transformer_checkpoint_to_diffusers`` reads it).

A single file's config comes from its shapes unless passed.

jaxdit's parameters keep diffusers' names where they are one tensor, so the table is one rule per tensor
(torch ``Linear`` weights transposed to [in, out] kernels); every source key is consumed and a missing,
extra or mis-shaped tensor is a :class:`CheckpointError` naming the key and the file.
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
from converters.keymap import (
    IDENTITY,
    TRANSPOSE,
    KeyRule,
    KeyTable,
    Slice,
    StateDict,
    Without,
    resolve,
    where,
)
from converters.safetensors_io import CheckpointFiles, open_checkpoint
from jaxdit.models.z_image import abstract_model
from jaxdit.models.z_image_config import ZImageConfig

__all__ = [
    "CHECKPOINTS",
    "ZImageCheckpoint",
    "detect",
    "diffusers_table",
    "diffusers_to_params",
    "original_table",
]

DIFFUSERS_CLASS = "ZImageTransformer2DModel"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")
#: Keys only a Z-Image transformer has (how a single file is recognised).
MARKERS = ("cap_pad_token", "x_pad_token")
STACKS = ("noise_refiner", "context_refiner", "layers")


def _linear(target: str, source: str, stack: str | None = None, bias: bool = True) -> list[KeyRule]:
    rules = [KeyRule(f"{target}.kernel", f"{source}.weight", TRANSPOSE, stack)]
    if bias:
        rules.append(KeyRule(f"{target}.bias", f"{source}.bias", IDENTITY, stack))
    return rules


def _block_rules(stack: str, modulation: bool) -> list[KeyRule]:
    blk = f"{stack}.{{i}}"
    rules = []
    for name in ("to_q", "to_k", "to_v"):
        rules += _linear(f"{stack}.{name}", f"{blk}.attention.{name}", stack, bias=False)
    rules += _linear(f"{stack}.to_out", f"{blk}.attention.to_out.0", stack, bias=False)
    for name in ("norm_q", "norm_k"):
        rules.append(KeyRule(f"{stack}.{name}", f"{blk}.attention.{name}.weight", IDENTITY, stack))
    for name in ("w1", "w2", "w3"):
        rules += _linear(f"{stack}.feed_forward.{name}", f"{blk}.feed_forward.{name}", stack, bias=False)
    for name in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
        rules.append(KeyRule(f"{stack}.{name}", f"{blk}.{name}.weight", IDENTITY, stack))
    if modulation:
        # nn.Sequential(Linear): the Linear is entry 0 (no SiLU before it in these blocks).
        rules += _linear(f"{stack}.adaLN_modulation", f"{blk}.adaLN_modulation.0", stack)
    return rules


def diffusers_table(cfg: ZImageConfig) -> KeyTable:
    """diffusers ``ZImageTransformer2DModel`` state dict -> jaxdit parameters."""
    patch = f"{cfg.patch_size}-{cfg.f_patch_size}"
    rules = _linear("t_embedder.linear_1", "t_embedder.mlp.0") + _linear(
        "t_embedder.linear_2", "t_embedder.mlp.2"
    )
    rules += _linear("x_embedder", f"all_x_embedder.{patch}")
    rules.append(KeyRule("cap_norm", "cap_embedder.0.weight"))
    rules += _linear("cap_embedder", "cap_embedder.1")
    rules += [KeyRule("x_pad_token", "x_pad_token"), KeyRule("cap_pad_token", "cap_pad_token")]
    depths = {
        "noise_refiner": cfg.n_refiner_layers,
        "context_refiner": cfg.n_refiner_layers,
        "layers": cfg.n_layers,
    }
    for stack in STACKS:
        if depths[stack]:
            rules += _block_rules(stack, modulation=stack != "context_refiner")
    # FinalLayer: nn.Sequential(SiLU, Linear) -> entry 1.
    rules += _linear("final_modulation", f"all_final_layer.{patch}.adaLN_modulation.1")
    rules += _linear("final_linear", f"all_final_layer.{patch}.linear")
    return KeyTable("Z-Image diffusers", tuple(rules), depths)


#: The original file's key spellings -> diffusers' (key fragments, applied in order).
_ORIGINAL_NAMES = (
    (".attention.out.", ".attention.to_out.0."),
    (".attention.q_norm.", ".attention.norm_q."),
    (".attention.k_norm.", ".attention.norm_k."),
)
#: A tensor the original file carries that no layer reads (diffusers drops it too).
UNUSED_ORIGINAL = "norm_final.weight"


def original_table(cfg: ZImageConfig) -> KeyTable:
    """The original single file (ComfyUI's) -> jaxdit parameters: diffusers' table with the original
    names, q / k / v read as thirds of the fused ``attention.qkv.weight`` rows."""
    diffusers = diffusers_table(cfg)
    patch = f"all_x_embedder.{cfg.patch_size}-{cfg.f_patch_size}."
    final = f"all_final_layer.{cfg.patch_size}-{cfg.f_patch_size}."
    e = cfg.dim
    rules = []
    for rule in diffusers.rules:
        (source,) = rule.sources
        part = next(
            (i for i, n in enumerate(("to_q", "to_k", "to_v")) if source.endswith(f".attention.{n}.weight")),
            None,
        )
        if part is not None:
            fused = source.rsplit(".attention.", 1)[0] + ".attention.qkv.weight"
            hook = Slice(0, part * e, (part + 1) * e, transpose=True, label=f"split_qkv {'qkv'[part]}")
            rules.append(KeyRule(rule.target, fused, hook, rule.stack))
            continue
        source = source.replace(patch, "x_embedder.").replace(final, "final_layer.")
        for old, new in _ORIGINAL_NAMES:
            source = source.replace(new, old)
        rules.append(KeyRule(rule.target, source, rule.hook, rule.stack))
    return KeyTable("Z-Image original", tuple(rules), diffusers.layers)


@dataclasses.dataclass
class ZImageCheckpoint:
    """An opened Z-Image transformer checkpoint: its files, key prefix and config."""

    files: CheckpointFiles
    prefix: str
    config: ZImageConfig
    layout: str = "diffusers"  # or "original"

    @property
    def table(self) -> KeyTable:
        return original_table(self.config) if self.layout == "original" else diffusers_table(self.config)

    @property
    def dtype(self) -> np.dtype:
        return self.files.dtype(self.prefix + "x_pad_token")

    def resolve(self, expected: Mapping[str, tuple[int, ...]]):
        source: Any = self.files
        unused = self.prefix + UNUSED_ORIGINAL
        if self.layout == "original" and unused in set(self.files.keys()):
            source = Without(self.files, {unused})
        return resolve(self.table, source, expected, prefix=self.prefix)


def _diffusers_folder(path: Path) -> Path | None:
    """The folder holding a diffusers Z-Image transformer: ``path`` or a pipeline's ``transformer/``."""
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


def config_from_shapes(shapes: Mapping[str, tuple[int, ...]]) -> ZImageConfig:
    """A single file without its config.json: the config from the tensors' shapes (diffusers keys). The
    head count and RoPE split are not in the weights: a head_dim other than the released 128 is refused."""
    if "x_embedder.weight" in shapes:  # the original file: patch size 2 x 1, as released
        patch, f_patch, embedder, norm_q = 2, 1, "x_embedder.weight", "layers.0.attention.q_norm.weight"
    else:
        embedders = [k for k in shapes if k.startswith("all_x_embedder.") and k.endswith(".weight")]
        if len(embedders) != 1:
            raise CheckpointError(f"expected one all_x_embedder, found {len(embedders)}")
        patch, f_patch = (int(v) for v in embedders[0].split(".")[1].split("-"))
        embedder, norm_q = embedders[0], "layers.0.attention.norm_q.weight"
    dim, features = shapes[embedder]
    head_dim = shapes[norm_q][0] if norm_q in shapes else 128
    if head_dim != 128:
        raise CheckpointError(f"head_dim {head_dim}: pass the config (the RoPE split is not in the weights)")

    def depth(stack):
        found = {int(k.split(".")[1]) for k in shapes if k.startswith(stack + ".")}
        return max(found) + 1 if found else 0

    return ZImageConfig(
        patch_size=patch,
        f_patch_size=f_patch,
        in_channels=features // (patch * patch * f_patch),
        dim=dim,
        n_layers=depth("layers"),
        n_refiner_layers=depth("noise_refiner"),
        n_heads=dim // head_dim,
        cap_feat_dim=shapes["cap_embedder.1.weight"][1],
    )


def _prefix(keys: set[str]) -> str | None:
    return next((p for p in PREFIXES if all(p + m in keys for m in MARKERS)), None)


def is_z_image_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` looks like a Z-Image transformer (cheap: config or header keys only)."""
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
    return _prefix(keys) is not None


def detect(
    path: str | os.PathLike[str], config: ZImageConfig | Mapping[str, Any] | None = None
) -> ZImageCheckpoint:
    """Open a Z-Image transformer checkpoint and work out its config (``config``, a ``ZImageConfig`` or a
    diffusers config dict, overrides it; shapes are still checked)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if isinstance(config, Mapping):
        config = ZImageConfig.from_diffusers(config)
    folder = _diffusers_folder(path) if path.is_dir() else None
    if folder is not None:
        try:
            cfg = config or ZImageConfig.from_diffusers(folder / "config.json")
        except ValueError as e:
            raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
        return ZImageCheckpoint(open_checkpoint(folder), "", cfg)
    files = open_checkpoint(path)
    keys = set(files.keys())
    prefix = _prefix(keys)
    if prefix is None:
        raise CheckpointError(
            f"{where(files)}: not a Z-Image transformer (no {' / '.join(MARKERS)}, bare or under "
            f"{' / '.join(p for p in PREFIXES if p)}; expected a diffusers {DIFFUSERS_CLASS} folder)"
        )
    if config is None:
        n = len(prefix)
        try:
            config = config_from_shapes({k[n:]: files.shape(k) for k in keys if k.startswith(prefix)})
        except KeyError as e:
            raise CheckpointError(f"{where(files)}: cannot infer the Z-Image config, no tensor {e}") from None
    layout = "original" if prefix + "x_embedder.weight" in keys else "diffusers"
    return ZImageCheckpoint(files, prefix, config, layout)


def diffusers_to_params(cfg: ZImageConfig, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A diffusers state dict (numpy-convertible values) -> jaxdit parameter arrays, by path."""
    from jaxdit.models.z_image import parameter_shapes

    lazies = resolve(diffusers_table(cfg), StateDict(state_dict), parameter_shapes(cfg))
    return {p: np.asarray(t) for p, t in lazies.items()}


#: Z-Image transformer checkpoints as ``jaxdit.loading.params.load_params`` reads them.
CHECKPOINTS = CheckpointFormat(
    name="z-image",
    detect=is_z_image_checkpoint,
    open=detect,
    config_class=ZImageConfig,
    abstract_model=abstract_model,
)
