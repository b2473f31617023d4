"""HunyuanVideo 1.5 VAE checkpoints (diffusers ``AutoencoderKLHunyuanVideo15``: ``vae/config.json`` +
safetensors) -> jaxdit parameters (``jaxdit/vae/hunyuan_video15_vae.py``).

jaxdit keeps diffusers' module names, so the key table is derived from the model's own parameter paths:
a causal convolution's ``X.kernel`` / ``X.bias`` come from ``X.conv.weight`` / ``X.conv.bias`` (diffusers
wraps the ``Conv3d``), a 1 x 1 x 1 convolution's from ``X.weight`` / ``X.bias``, kernels moved channels
last ([O, I, kt, kh, kw] -> [kt, kh, kw, I, O]); the RMS norms' ``gamma`` [C, 1, 1, 1] read as [C]; a level's
``resample`` is diffusers' ``downsamplers.0`` / ``upsamplers.0``. Every source key is consumed (strict
``resolve``), so an extra, missing or mis-shaped tensor is an error naming the key and the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from converters.errors import CheckpointError
from converters.keymap import Hook, KeyRule, KeyTable, StateDict, resolve
from converters.safetensors_io import LazyTensor, open_checkpoint, transpose
from jaxdit.vae.hunyuan_video15_vae import HunyuanVideo15VAEConfig, parameter_shapes

__all__ = ["detect", "diffusers_table", "diffusers_to_params"]

DIFFUSERS_CLASS = "AutoencoderKLHunyuanVideo15"


@dataclasses.dataclass(frozen=True)
class ConvKernel(Hook):
    """A torch ``Conv3d`` weight [O, I, kt, kh, kw] as a channels-last kernel [kt, kh, kw, I, O]."""

    name: ClassVar[str] = "conv3d_channels_last"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        if sources[0].ndim != 5:
            raise ValueError(f"expects a Conv3d weight [O, I, kt, kh, kw], got {tuple(sources[0].shape)}")
        return transpose(sources[0], (2, 3, 4, 1, 0))

    def invert(self, target: np.ndarray):
        src = np.ascontiguousarray(np.asarray(target).transpose(4, 3, 0, 1, 2))
        return [(0, tuple((0, d) for d in src.shape), src)]


class _Flat(LazyTensor):
    """[C, 1, ..., 1] read as [C]."""

    def __init__(self, source: LazyTensor) -> None:
        self._source = source
        self.shape = (source.shape[0],)
        self.dtype = source.dtype

    def _read(self, box):
        full = (box[0],) + tuple((0, 1) for _ in self._source.shape[1:])
        return self._source._read(full).reshape(-1)


@dataclasses.dataclass(frozen=True)
class NormGamma(Hook):
    """An RMS norm's gamma [C, 1, 1, 1] as [C]."""

    name: ClassVar[str] = "norm_gamma"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        src = sources[0]
        if src.ndim < 1 or math.prod(src.shape[1:]) != 1:
            raise ValueError(f"expects a gamma [C, 1, ...], got {tuple(src.shape)}")
        return _Flat(src)

    def invert(self, target: np.ndarray):
        src = np.asarray(target).reshape(-1, 1, 1, 1)
        return [(0, tuple((0, d) for d in src.shape), src)]


def _source(path: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, Hook | None]:
    """The diffusers key and hook of one jaxdit parameter path."""
    module, leaf = path.rsplit(".", 1)
    src = module.replace(".resample", ".downsamplers.0" if module.startswith("encoder.") else ".upsamplers.0")
    if leaf == "gamma":
        return f"{src}.gamma", NormGamma()
    causal = shapes[f"{module}.kernel"][0] > 1
    base = f"{src}.conv" if causal else src
    return (f"{base}.weight", ConvKernel()) if leaf == "kernel" else (f"{base}.bias", None)


def diffusers_table(cfg: HunyuanVideo15VAEConfig) -> KeyTable:
    shapes = parameter_shapes(cfg)
    rules = []
    for path in shapes:
        key, hook = _source(path, shapes)
        rules.append(KeyRule(path, key) if hook is None else KeyRule(path, key, hook))
    return KeyTable("HunyuanVideo 1.5 VAE diffusers", tuple(rules))


@dataclasses.dataclass
class HunyuanVideo15VAECheckpoint:
    files: Any
    config: HunyuanVideo15VAEConfig

    def resolve(self, expected: Mapping[str, tuple[int, ...]] | None = None):
        return resolve(diffusers_table(self.config), self.files, expected or parameter_shapes(self.config))


def detect(path: str | os.PathLike[str]) -> HunyuanVideo15VAECheckpoint:
    """A diffusers ``AutoencoderKLHunyuanVideo15`` folder (or the pipeline folder holding ``vae/``)."""
    path = Path(path)
    for folder in (path, path / "vae"):
        cfg = folder / "config.json"
        if cfg.is_file():
            try:
                data = json.loads(cfg.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{cfg}: cannot read the config: {e}") from e
            if data.get("_class_name") == DIFFUSERS_CLASS:
                try:
                    config = HunyuanVideo15VAEConfig.from_diffusers(data)
                except ValueError as e:
                    raise CheckpointError(f"{cfg}: {e}") from None
                return HunyuanVideo15VAECheckpoint(open_checkpoint(folder), config)
    raise CheckpointError(f"{path}: not a diffusers {DIFFUSERS_CLASS} folder (no config.json naming it)")


def diffusers_to_params(cfg: HunyuanVideo15VAEConfig, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A diffusers state dict (numpy-convertible values) -> jaxdit parameter arrays, by path."""
    lazies = resolve(diffusers_table(cfg), StateDict(state_dict), parameter_shapes(cfg))
    return {p: np.asarray(t) for p, t in lazies.items()}
