"""FLUX.2's transformer config (diffusers' ``Flux2Transformer2DModel`` names), its presets, and the 4-axis
RoPE ids (time, row, column, text position) its pipelines build."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

#: Token groups of the joint sequence, in the order every shard holds them: the text, the denoised image,
#: then the clean reference-image tokens (multi-reference editing), which ride in the image stream.
TEXT, IMAGE, REFERENCE = 0, 1, 2
#: Blocks per stack a config may ask for: far above any released model (FLUX.2-dev: 8 + 48).
MAX_BLOCKS = 1000
#: The time coordinate of the k-th reference image is ``REFERENCE_TIME_STEP * (k + 1)`` (diffusers'
#: ``Flux2Pipeline._prepare_image_ids`` default ``scale=10``); the generated image sits at time 0.
REFERENCE_TIME_STEP = 10


@dataclasses.dataclass(frozen=True)
class Flux2Config:
    """Hyper-parameters of a FLUX.2 transformer (diffusers' names; ``out_channels`` per token before the
    patch factor, None = ``in_channels``)."""

    patch_size: int = 1
    in_channels: int = 128  # 32 latent channels x 2 x 2 (the pipeline patchifies before packing)
    out_channels: int | None = None
    num_layers: int = 8  # double-stream blocks
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360  # three stacked hidden states of the text encoder
    timestep_guidance_channels: int = 256
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)  # (time, row, column, text position)
    rope_theta: float = 2000.0
    eps: float = 1e-6
    guidance_embeds: bool = True  # dev: the distilled guidance input; klein: none

    #: Full-size transformers as published (the ``transformer/config.json`` of black-forest-labs'
    #: FLUX.2-dev, FLUX.2-klein-4B and FLUX.2-klein-9B repositories).
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "flux2-dev": {},
        "flux2-klein-4b": dict(
            num_layers=5,
            num_single_layers=20,
            num_attention_heads=24,
            joint_attention_dim=7680,
            guidance_embeds=False,
        ),
        "flux2-klein-9b": dict(
            num_layers=8,
            num_single_layers=24,
            num_attention_heads=32,
            joint_attention_dim=12288,
            guidance_embeds=False,
        ),
    }

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dims_rope", tuple(int(a) for a in self.axes_dims_rope))
        for name in (
            "patch_size",
            "in_channels",
            "attention_head_dim",
            "num_attention_heads",
            "joint_attention_dim",
            "timestep_guidance_channels",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"Flux2Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.out_channels is not None and self.out_channels < 1:
            raise ValueError(f"Flux2Config.out_channels must be >= 1 or None, got {self.out_channels}")
        for name in ("num_layers", "num_single_layers"):
            if not 0 <= getattr(self, name) <= MAX_BLOCKS:
                raise ValueError(f"Flux2Config.{name} {getattr(self, name)} is outside 0..{MAX_BLOCKS}")
        if any(a % 2 or a < 0 for a in self.axes_dims_rope) or sum(self.axes_dims_rope) != self.head_dim:
            raise ValueError(
                f"axes_dims_rope {self.axes_dims_rope} must be even sizes summing to attention_head_dim "
                f"{self.head_dim}"
            )
        if self.timestep_guidance_channels % 2:
            raise ValueError(f"timestep_guidance_channels {self.timestep_guidance_channels} must be even")
        if self.mlp_hidden < 1:
            raise ValueError(f"mlp_ratio {self.mlp_ratio} gives an empty MLP")

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim

    @property
    def mlp_hidden(self) -> int:
        """Width of one SwiGLU half (diffusers: ``int(dim * mlp_ratio)``)."""
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def output_features(self) -> int:
        """Features per output token: patch_size**2 x out_channels."""
        return self.patch_size**2 * (self.out_channels or self.in_channels)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Flux2Config:
        if name not in cls.PRESETS:
            raise ValueError(f"unknown FLUX.2 preset {name!r}; known: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> Flux2Config:
        """From a diffusers ``Flux2Transformer2DModel`` ``config.json`` (a path or the parsed dict)."""
        if not isinstance(config, Mapping):
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        c = dict(config)
        if c.get("_class_name") not in ("Flux2Transformer2DModel", None):
            raise ValueError(f"config is for {c.get('_class_name')!r}, not Flux2Transformer2DModel")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if k == "axes_dims_rope" else v) for k, v in c.items() if k in names})

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Flux2Config:
        return cls(**{k: (tuple(v) if k == "axes_dims_rope" else v) for k, v in data.items()})


def text_ids(tokens: int) -> np.ndarray:
    """[T, 4] ids of the text tokens: (0, 0, 0, j) for token j (diffusers' ``_prepare_text_ids``)."""
    ids = np.zeros((tokens, 4), np.int32)
    ids[:, 3] = np.arange(tokens)
    return ids


def image_ids(rows: int, cols: int, time: int = 0) -> np.ndarray:
    """[rows * cols, 4] ids of a packed latent grid, row-major: (time, r, c, 0)."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    ids = np.zeros((rows * cols, 4), np.int32)
    ids[:, 0], ids[:, 1], ids[:, 2] = time, r.reshape(-1), c.reshape(-1)
    return ids


def reference_ids(grids: Sequence[tuple[int, int]]) -> np.ndarray:
    """[sum(rows * cols), 4] ids of reference images joined along the sequence, image k of (rows, cols)
    at time ``REFERENCE_TIME_STEP * (k + 1)`` (diffusers' ``_prepare_image_ids``)."""
    if not grids:
        raise ValueError("reference_ids needs at least one reference grid")
    return np.concatenate(
        [image_ids(r, c, REFERENCE_TIME_STEP * (k + 1)) for k, (r, c) in enumerate(grids)], axis=0
    )
