"""Qwen-Image's transformer config (diffusers' ``QwenImageTransformer2DModel`` fields), its preset, the
config file it is read from, and the RoPE positions of its text and image tokens."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

__all__ = ["IMAGE", "REFERENCE", "TEXT", "QwenImageConfig", "edit_rope_positions", "rope_positions"]

#: Token groups of the joint sequence, in the order every shard holds them ([text; image], as diffusers
#: concatenates them).
TEXT, IMAGE, REFERENCE = 0, 1, 2  # REFERENCE: the edit pipelines' clean input-image tokens
#: Blocks a config may ask for (Qwen-Image: 60); more is a typo that would cost minutes of building.
MAX_BLOCKS = 1000
#: diffusers' switches of the later Qwen-Image variants (Layered's extra condition and 3-D layer RoPE),
#: not implemented here (Edit-2511's ``zero_cond_t`` is).
_VARIANT_SWITCHES = ("use_additional_t_cond", "use_layer3d_rope", "guidance_embeds")


@dataclasses.dataclass(frozen=True)
class QwenImageConfig:
    """Hyper-parameters of a Qwen-Image MMDiT (diffusers' names; ``out_channels`` per latent pixel)."""

    patch_size: int = 2
    in_channels: int = 64  # packed: 16 latent channels x 2 x 2
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584  # Qwen2.5-VL-7B's hidden size
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)  # (frame, row, column) RoPE dims; sum = head_dim
    theta: float = 10000.0
    #: Edit-2511: the reference tokens' image-stream modulation is the embedding of timestep 0.
    zero_cond_t: bool = False
    mlp_ratio: int = 4  # diffusers' FeedForward default

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"qwen-image": {}}

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dims_rope", tuple(int(a) for a in self.axes_dims_rope))
        for name in (
            "patch_size",
            "in_channels",
            "out_channels",
            "attention_head_dim",
            "num_attention_heads",
            "joint_attention_dim",
            "mlp_ratio",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"QwenImageConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.num_layers <= MAX_BLOCKS:
            raise ValueError(f"QwenImageConfig.num_layers {self.num_layers} is outside 0..{MAX_BLOCKS}")
        if (
            len(self.axes_dims_rope) != 3
            or any(a % 2 for a in self.axes_dims_rope)
            or sum(self.axes_dims_rope) != self.attention_head_dim
        ):
            raise ValueError(
                f"axes_dims_rope {self.axes_dims_rope} must be three even sizes summing to "
                f"attention_head_dim {self.attention_head_dim}"
            )

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
    def output_features(self) -> int:
        """Features per output token: the packed patch, patch_size**2 x out_channels."""
        return self.patch_size**2 * self.out_channels

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> QwenImageConfig:
        if name not in cls.PRESETS:
            raise ValueError(f"unknown Qwen-Image preset {name!r}; known: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> QwenImageConfig:
        """From a diffusers ``QwenImageTransformer2DModel`` ``config.json`` (a path or the parsed dict)."""
        if not isinstance(config, Mapping):
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        c = dict(config)
        if c.get("_class_name") not in ("QwenImageTransformer2DModel", None):
            raise ValueError(f"config is for {c.get('_class_name')!r}, not QwenImageTransformer2DModel")
        variant = [k for k in _VARIANT_SWITCHES if c.get(k)]
        if variant:
            raise ValueError(f"config sets {', '.join(variant)}: that Qwen-Image variant is not supported")
        in_channels = int(c.get("in_channels", 64))
        return cls(
            patch_size=int(c.get("patch_size", 2)),
            in_channels=in_channels,
            out_channels=int(c.get("out_channels") or in_channels),
            num_layers=int(c.get("num_layers", 60)),
            attention_head_dim=int(c.get("attention_head_dim", 128)),
            num_attention_heads=int(c.get("num_attention_heads", 24)),
            joint_attention_dim=int(c.get("joint_attention_dim", 3584)),
            axes_dims_rope=tuple(c.get("axes_dims_rope", (16, 56, 56))),
            zero_cond_t=bool(c.get("zero_cond_t", False)),
        )

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> QwenImageConfig:
        return cls(**{k: (tuple(v) if k == "axes_dims_rope" else v) for k, v in data.items()})


def rope_positions(text_tokens: int, rows: int, cols: int, frames: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(text ids [T, 3], image ids [frames * rows * cols, 3]) as diffusers' ``QwenEmbedRope`` places them
    (``scale_rope=True``): image rows and columns centred on 0, row r at r - (rows - rows // 2) and column
    c likewise, frame f at f; text token j at m + j on all three axes, m = max(rows // 2, cols // 2), so the
    text sits on the diagonal just past the image. ``rows``/``cols`` count packed (2 x 2) patches.
    """
    f, r, c = np.meshgrid(
        np.arange(frames),
        np.arange(rows) - (rows - rows // 2),
        np.arange(cols) - (cols - cols // 2),
        indexing="ij",
    )
    image = np.stack([f, r, c], axis=-1).reshape(-1, 3).astype(np.int32)
    start = max(rows // 2, cols // 2)
    text = np.repeat((start + np.arange(text_tokens, dtype=np.int32))[:, None], 3, axis=1)
    return text, image


def edit_rope_positions(
    text_tokens: int, grids: list[tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(text ids [T, 3], image ids, reference ids) for an edit call (diffusers' ``QwenEmbedRope`` with
    ``img_shapes`` = the denoised image then each reference): ``grids`` [(rows, cols)] in packed tokens,
    the denoised image first. Frame k is the k-th grid (0: the denoised image), each centred on its own
    rows and columns; the text starts past the largest half side of them all."""
    if not grids:
        raise ValueError("an edit call needs the denoised image's grid")
    ids = []
    for k, (rows, cols) in enumerate(grids):
        _, frame = rope_positions(0, rows, cols)
        frame[:, 0] = k
        ids.append(frame)
    start = max(max(r // 2, c // 2) for r, c in grids)
    text = np.repeat((start + np.arange(text_tokens, dtype=np.int32))[:, None], 3, axis=1)
    return text, ids[0], np.concatenate(ids[1:], axis=0) if len(ids) > 1 else np.zeros((0, 3), np.int32)
