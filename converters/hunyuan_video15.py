"""HunyuanVideo 1.5 transformer checkpoints -> jaxdit parameters (``jaxdit/models/hunyuan_video15.py``).

Layout: diffusers ``HunyuanVideo15Transformer3DModel``, a ``transformer/`` folder (``config.json`` +
safetensors, sharded with an index as the hunyuanvideo-community folders ship it) or the pipeline folder
holding it. jaxdit's parameters keep diffusers' names where they are one tensor (the token refiner's
blocks are stacked as ``refiner_blocks``), so the table is one rule per tensor: torch ``Linear`` weights
transposed to [in, out] kernels, the patch embedding's Conv3d weight flattened per patch. Every source key
is consumed; a missing, extra or mis-shaped tensor is a :class:`CheckpointError` naming the key and the
file (``converters/keymap.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from converters.checkpoints import CheckpointFormat
from converters.errors import CheckpointError
from converters.keymap import IDENTITY, TRANSPOSE, Hook, KeyRule, KeyTable, StateDict, resolve
from converters.safetensors_io import CheckpointFiles, LazyTensor, open_checkpoint
from jaxdit.models.hunyuan_video15 import abstract_model
from jaxdit.models.hunyuan_video15_config import HunyuanVideo15Config

__all__ = ["CHECKPOINTS", "HunyuanVideo15Checkpoint", "detect", "diffusers_table", "diffusers_to_params"]

DIFFUSERS_CLASS = "HunyuanVideo15Transformer3DModel"
BLOCKS, REFINER = "transformer_blocks", "refiner_blocks"


class _PatchKernel(LazyTensor):
    """A Conv3d weight [E, C, pt, ph, pw] read as [C*pt*ph*pw, E]. The weight is small (E x one patch),
    so a box reads all its patch features for the box's range of E."""

    def __init__(self, source: LazyTensor) -> None:
        self._source = source
        e, *patch = source.shape
        self.shape = (int(np.prod(patch)), e)
        self.dtype = source.dtype

    def _read(self, box):
        (lo, hi), (e_lo, e_hi) = box
        full = ((e_lo, e_hi),) + tuple((0, d) for d in self._source.shape[1:])
        block = self._source._read(full).reshape(e_hi - e_lo, -1)
        return np.ascontiguousarray(block.T[lo:hi])


@dataclasses.dataclass(frozen=True)
class PatchEmbedKernel(Hook):
    """The patch embedding's Conv3d weight [E, C, pt, ph, pw] (kernel = stride = patch) as the kernel of
    one linear map per patch [C*pt*ph*pw, E], features in the weight's own (c, t, h, w) order."""

    in_channels: int
    patch: tuple[int, int, int]
    name: ClassVar[str] = "patch_embed_kernel"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        src, want = sources[0], (self.in_channels, *self.patch)
        if src.ndim != 5 or tuple(src.shape[1:]) != want:
            raise ValueError(
                f"expects a Conv3d weight [E, {', '.join(map(str, want))}], got {tuple(src.shape)}"
            )
        return _PatchKernel(src)

    def invert(self, target: np.ndarray):
        src = np.asarray(target).T.reshape(target.shape[-1], self.in_channels, *self.patch)
        return [(0, tuple((0, d) for d in src.shape), np.ascontiguousarray(src))]


def _linear(target: str, source: str, stack: str | None = None) -> list[KeyRule]:
    return [
        KeyRule(f"{target}.kernel", f"{source}.weight", TRANSPOSE, stack),
        KeyRule(f"{target}.bias", f"{source}.bias", IDENTITY, stack),
    ]


def _norm(target: str, source: str, stack: str | None = None) -> list[KeyRule]:
    return [
        KeyRule(f"{target}.weight", f"{source}.weight", IDENTITY, stack),
        KeyRule(f"{target}.bias", f"{source}.bias", IDENTITY, stack),
    ]


def _mlp(target: str, source: str, stack: str) -> list[KeyRule]:
    """diffusers' ``FeedForward``: net.0.proj (in), net.2 (out)."""
    return _linear(f"{target}.proj", f"{source}.net.0.proj", stack) + _linear(
        f"{target}.out", f"{source}.net.2", stack
    )


def diffusers_table(cfg: HunyuanVideo15Config) -> KeyTable:
    """diffusers ``HunyuanVideo15Transformer3DModel`` state dict -> jaxdit parameters."""
    rules = [
        KeyRule("x_embedder.kernel", "x_embedder.proj.weight", PatchEmbedKernel(cfg.in_channels, cfg.patch)),
        KeyRule("x_embedder.bias", "x_embedder.proj.bias"),
    ]
    rules += _norm("image_embedder.norm_in", "image_embedder.norm_in")
    rules += _linear("image_embedder.linear_1", "image_embedder.linear_1")
    rules += _linear("image_embedder.linear_2", "image_embedder.linear_2")
    rules += _norm("image_embedder.norm_out", "image_embedder.norm_out")
    tte = "context_embedder.time_text_embed"
    for part in ("timestep_embedder", "text_embedder"):
        for lin in ("linear_1", "linear_2"):
            rules += _linear(f"context_embedder.{part}.{lin}", f"{tte}.{part}.{lin}")
    rules += _linear("context_embedder.proj_in", "context_embedder.proj_in")
    ref = "context_embedder.token_refiner.refiner_blocks.{i}"
    rules += _norm(f"{REFINER}.norm1", f"{ref}.norm1", REFINER)
    for name in ("to_q", "to_k", "to_v"):
        rules += _linear(f"{REFINER}.{name}", f"{ref}.attn.{name}", REFINER)
    rules += _linear(f"{REFINER}.to_out", f"{ref}.attn.to_out.0", REFINER)
    rules += _norm(f"{REFINER}.norm2", f"{ref}.norm2", REFINER)
    rules += _mlp(f"{REFINER}.ff", f"{ref}.ff", REFINER)
    rules += _linear(f"{REFINER}.norm_out", f"{ref}.norm_out.linear", REFINER)
    rules += _norm("context_embedder_2.norm", "context_embedder_2.norm")
    for lin in ("linear_1", "linear_2", "linear_3"):
        rules += _linear(f"context_embedder_2.{lin}", f"context_embedder_2.{lin}")
    for lin in ("linear_1", "linear_2"):
        rules += _linear(f"time_embed.{lin}", f"time_embed.timestep_embedder.{lin}")
        if cfg.use_meanflow:
            rules += _linear(f"time_embed_r.{lin}", f"time_embed.timestep_embedder_r.{lin}")
    rules.append(KeyRule("cond_type_embed", "cond_type_embed.weight"))
    blk = f"{BLOCKS}.{{i}}"
    rules += _linear(f"{BLOCKS}.norm1", f"{blk}.norm1.linear", BLOCKS)
    rules += _linear(f"{BLOCKS}.norm1_context", f"{blk}.norm1_context.linear", BLOCKS)
    for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
        rules += _linear(f"{BLOCKS}.{name}", f"{blk}.attn.{name}", BLOCKS)
    rules += _linear(f"{BLOCKS}.to_out", f"{blk}.attn.to_out.0", BLOCKS)
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        rules.append(KeyRule(f"{BLOCKS}.{name}", f"{blk}.attn.{name}.weight", IDENTITY, BLOCKS))
    rules += _mlp(f"{BLOCKS}.ff", f"{blk}.ff", BLOCKS) + _mlp(
        f"{BLOCKS}.ff_context", f"{blk}.ff_context", BLOCKS
    )
    # AdaLayerNormContinuous: (scale, shift), the order the model splits it in; no swap.
    rules += _linear("norm_out", "norm_out.linear") + _linear("proj_out", "proj_out")
    layers = {BLOCKS: cfg.num_layers, REFINER: cfg.num_refiner_layers}
    rules = [r for r in rules if r.stack is None or layers[r.stack] > 0]
    return KeyTable("HunyuanVideo 1.5 diffusers", tuple(rules), layers)


@dataclasses.dataclass
class HunyuanVideo15Checkpoint:
    """An opened HunyuanVideo 1.5 transformer checkpoint: its files and config."""

    files: CheckpointFiles
    prefix: str
    config: HunyuanVideo15Config

    @property
    def table(self) -> KeyTable:
        return diffusers_table(self.config)

    @property
    def dtype(self) -> np.dtype:
        return self.files.dtype(self.prefix + "x_embedder.proj.weight")

    def resolve(self, expected: Mapping[str, tuple[int, ...]]):
        return resolve(self.table, self.files, expected, prefix=self.prefix)


def _diffusers_folder(path: Path) -> Path | None:
    """The folder holding a diffusers HunyuanVideo 1.5 transformer: ``path`` or a pipeline's
    ``transformer/``."""
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


def is_hunyuan_video15_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a diffusers HunyuanVideo 1.5 transformer folder (cheap: its config only)."""
    path = Path(path)
    return path.is_dir() and _diffusers_folder(path) is not None


def detect(
    path: str | os.PathLike[str], config: HunyuanVideo15Config | Mapping[str, Any] | None = None
) -> HunyuanVideo15Checkpoint:
    """Open a diffusers HunyuanVideo 1.5 transformer folder and read its config (``config``, a
    ``HunyuanVideo15Config`` or a diffusers config dict, overrides it; shapes are still checked)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if isinstance(config, Mapping):
        config = HunyuanVideo15Config.from_diffusers(config)
    folder = _diffusers_folder(path) if path.is_dir() else None
    if folder is None:
        raise CheckpointError(
            f"{path}: not a HunyuanVideo 1.5 transformer (expected a diffusers {DIFFUSERS_CLASS} folder with "
            "its config.json, or the pipeline folder holding it)"
        )
    try:
        cfg = config or HunyuanVideo15Config.from_diffusers(folder / "config.json")
    except ValueError as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    return HunyuanVideo15Checkpoint(open_checkpoint(folder), "", cfg)


def diffusers_to_params(cfg: HunyuanVideo15Config, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A diffusers state dict (numpy-convertible values) -> jaxdit parameter arrays, by path."""
    from jaxdit.models.hunyuan_video15 import parameter_shapes

    lazies = resolve(diffusers_table(cfg), StateDict(state_dict), parameter_shapes(cfg))
    return {p: np.asarray(t) for p, t in lazies.items()}


#: HunyuanVideo 1.5 transformer checkpoints as ``jaxdit.loading.params.load_params`` reads them.
CHECKPOINTS = CheckpointFormat(
    name="hunyuan-video15",
    detect=is_hunyuan_video15_checkpoint,
    open=detect,
    config_class=HunyuanVideo15Config,
    abstract_model=abstract_model,
)
