"""HunyuanVideo 1.5's transformer config (diffusers' ``HunyuanVideo15Transformer3DModel`` fields), its
presets, the config file it is read from, and the token groups of its joint sequence."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = ["GLYPH", "IMAGE", "TEXT", "VIDEO", "HunyuanVideo15Config"]

#: Token groups of the joint sequence, in the order every shard holds them: the video patches, the
#: Qwen2.5-VL prompt tokens, the ByT5 glyph tokens and the image-encoder tokens. diffusers moves each
#: sample's real text tokens in front of its padding before the blocks; attention does not care about key
#: order, so here each group keeps its order and its padding is masked instead.
VIDEO, TEXT, GLYPH, IMAGE = 0, 1, 2, 3
#: Blocks a config may ask for (HunyuanVideo 1.5: 54); more is a typo that would cost minutes of building.
MAX_BLOCKS = 1000
#: Width of the ByT5 mapper's hidden layers (fixed in diffusers' ``HunyuanVideo15ByT5TextProjection``).
GLYPH_HIDDEN = 2048


@dataclasses.dataclass(frozen=True)
class HunyuanVideo15Config:
    """Hyper-parameters of a HunyuanVideo 1.5 transformer (diffusers' names and defaults: the 8.3B model).

    ``in_channels`` per latent voxel: 32 noisy latent channels, 32 condition-latent channels and the
    condition mask; ``out_channels`` the latent channels predicted."""

    in_channels: int = 65
    out_channels: int = 32
    num_attention_heads: int = 16
    attention_head_dim: int = 128
    num_layers: int = 54
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 1
    patch_size_t: int = 1
    text_embed_dim: int = 3584  # Qwen2.5-VL-7B's hidden size
    text_embed_2_dim: int = 1472  # ByT5-small's hidden size
    image_embed_dim: int = 1152  # SigLIP's hidden size
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, int, int] = (16, 56, 56)  # (frame, row, column); sum = head_dim
    target_size: int = 640
    task_type: str = "i2v"
    use_meanflow: bool = False

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "hunyuanvideo1.5-480p": {"task_type": "t2v", "target_size": 640},
        "hunyuanvideo1.5-720p": {"task_type": "t2v", "target_size": 960},
        "hunyuanvideo1.5-480p-i2v": {"task_type": "i2v", "target_size": 640},
        "hunyuanvideo1.5-720p-i2v": {"task_type": "i2v", "target_size": 960},
    }

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_axes_dim", tuple(int(a) for a in self.rope_axes_dim))
        for name in (
            "in_channels",
            "out_channels",
            "num_attention_heads",
            "attention_head_dim",
            "patch_size",
            "patch_size_t",
            "text_embed_dim",
            "text_embed_2_dim",
            "image_embed_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"HunyuanVideo15Config.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_layers", "num_refiner_layers"):
            if not 0 <= getattr(self, name) <= MAX_BLOCKS:
                raise ValueError(
                    f"HunyuanVideo15Config.{name} {getattr(self, name)} is outside 0..{MAX_BLOCKS}"
                )
        if self.mlp_ratio <= 0 or int(self.hidden_size * self.mlp_ratio) < 1:
            raise ValueError(f"HunyuanVideo15Config.mlp_ratio must be > 0, got {self.mlp_ratio}")
        if (
            len(self.rope_axes_dim) != 3
            or any(a % 2 for a in self.rope_axes_dim)
            or sum(self.rope_axes_dim) != self.attention_head_dim
        ):
            raise ValueError(
                f"rope_axes_dim {self.rope_axes_dim} must be three even sizes summing to "
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
    def mlp_hidden(self) -> int:
        """diffusers' ``FeedForward(mult=mlp_ratio)`` width: int(hidden * mlp_ratio)."""
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def patch(self) -> tuple[int, int, int]:
        """(frames, rows, columns) of one patch."""
        return (self.patch_size_t, self.patch_size, self.patch_size)

    @property
    def input_features(self) -> int:
        """Features per input token: one patch of ``in_channels`` in the Conv3d weight's (c, t, h, w) order."""
        return self.in_channels * self.patch_size_t * self.patch_size**2

    @property
    def output_features(self) -> int:
        """Features per output token, in diffusers' (c, t, h, w) order."""
        return self.out_channels * self.patch_size_t * self.patch_size**2

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> HunyuanVideo15Config:
        if name not in cls.PRESETS:
            raise ValueError(f"unknown HunyuanVideo 1.5 preset {name!r}; known: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> HunyuanVideo15Config:
        """From a diffusers ``HunyuanVideo15Transformer3DModel`` ``config.json`` (a path or the parsed dict)."""
        if not isinstance(config, Mapping):
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        c = dict(config)
        if c.get("_class_name") not in ("HunyuanVideo15Transformer3DModel", None):
            raise ValueError(f"config is for {c.get('_class_name')!r}, not HunyuanVideo15Transformer3DModel")
        if c.get("qk_norm", "rms_norm") != "rms_norm":
            raise ValueError(f"qk_norm {c['qk_norm']!r}: only HunyuanVideo 1.5's 'rms_norm' is supported")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {k: c[k] for k in fields if k in c and c[k] is not None}
        if "out_channels" in c and not c["out_channels"]:  # diffusers: out_channels or in_channels
            kwargs["out_channels"] = kwargs.get("in_channels", cls.in_channels)
        return cls(**kwargs)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HunyuanVideo15Config:
        return cls(**{k: (tuple(v) if k == "rope_axes_dim" else v) for k, v in data.items()})
