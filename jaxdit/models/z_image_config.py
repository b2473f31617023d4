"""Z-Image's transformer config (diffusers' ``ZImageTransformer2DModel`` fields), its presets and the
config file it is read from."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = ["ADALN_DIM", "CAPTION", "IMAGE", "SEQ_MULTIPLE", "TIME_HIDDEN", "ZImageConfig"]

#: Token groups of the joint sequence, in the order every shard holds them ([image; caption], the order
#: diffusers joins them in).
IMAGE, CAPTION = 0, 1
#: Each caption and each image is padded to a multiple of this with the model's learnt pad tokens, which
#: then attend like real tokens (diffusers' ``SEQ_MULTI_OF``).
SEQ_MULTIPLE = 32
#: Width of the timestep embedding and of every AdaLN input: min(dim, 256) (diffusers' ``ADALN_EMBED_DIM``).
ADALN_DIM = 256
#: Hidden width of the timestep MLP (fixed in diffusers' ``TimestepEmbedder(mid_size=1024)``).
TIME_HIDDEN = 1024
#: Blocks a config may ask for (Z-Image: 30); more is a typo that would cost minutes of building.
MAX_BLOCKS = 1000


@dataclasses.dataclass(frozen=True)
class ZImageConfig:
    """Hyper-parameters of a Z-Image single-stream DiT (diffusers' names, one patch size)."""

    patch_size: int = 2
    f_patch_size: int = 1
    in_channels: int = 16
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    norm_eps: float = 1e-5
    cap_feat_dim: int = 2560  # Qwen3-4B's hidden size
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, int, int] = (32, 48, 48)  # (caption/frame, row, column) RoPE dims; sum = head_dim
    axes_lens: tuple[int, int, int] = (1024, 512, 512)  # positions each axis has frequencies for

    #: Turbo and the base model share one transformer architecture.
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"z-image-turbo": {}, "z-image": {}}

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dims", tuple(int(a) for a in self.axes_dims))
        object.__setattr__(self, "axes_lens", tuple(int(a) for a in self.axes_lens))
        for name in ("patch_size", "f_patch_size", "in_channels", "dim", "n_heads", "cap_feat_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ZImageConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_layers", "n_refiner_layers"):
            if not 0 <= getattr(self, name) <= MAX_BLOCKS:
                raise ValueError(f"ZImageConfig.{name} {getattr(self, name)} is outside 0..{MAX_BLOCKS}")
        if self.dim % self.n_heads:
            raise ValueError(f"ZImageConfig.dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if (
            len(self.axes_dims) != 3
            or len(self.axes_lens) != 3
            or any(a % 2 for a in self.axes_dims)
            or sum(self.axes_dims) != self.head_dim
        ):
            raise ValueError(
                f"axes_dims {self.axes_dims} must be three even sizes summing to head_dim {self.head_dim} "
                f"(with three axes_lens, got {self.axes_lens})"
            )

    @property
    def hidden_size(self) -> int:
        return self.dim

    @property
    def num_heads(self) -> int:
        return self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, ADALN_DIM)

    @property
    def mlp_hidden(self) -> int:
        """The SwiGLU width: int(dim / 3 * 8), as diffusers computes it (10240 for dim 3840)."""
        return int(self.dim / 3 * 8)

    @property
    def output_features(self) -> int:
        """Features per token in and out: one patch, (pf, ph, pw, channel) order."""
        return self.f_patch_size * self.patch_size**2 * self.in_channels

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ZImageConfig:
        if name not in cls.PRESETS:
            raise ValueError(f"unknown Z-Image preset {name!r}; known: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> ZImageConfig:
        """From a diffusers ``ZImageTransformer2DModel`` ``config.json`` (a path or the parsed dict)."""
        if not isinstance(config, Mapping):
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        c = dict(config)
        if c.get("_class_name") not in ("ZImageTransformer2DModel", None):
            raise ValueError(f"config is for {c.get('_class_name')!r}, not ZImageTransformer2DModel")
        if c.get("siglip_feat_dim") is not None:
            raise ValueError("config sets siglip_feat_dim: the Z-Image Omni variant is not supported")
        patches = [int(p) for p in c.get("all_patch_size", (2,))]
        f_patches = [int(p) for p in c.get("all_f_patch_size", (1,))]
        if len(patches) != 1 or len(f_patches) != 1:
            raise ValueError(
                f"config has patch sizes {patches} x {f_patches}: one patch size is supported, as released"
            )
        # n_kv_heads is not read: diffusers builds the attention with n_heads for keys and values too.
        heads = int(c.get("n_heads", 30))
        if not c.get("qk_norm", True):
            raise ValueError("config sets qk_norm=false: Z-Image without QK-norm is not supported")
        return cls(
            patch_size=patches[0],
            f_patch_size=f_patches[0],
            in_channels=int(c.get("in_channels", 16)),
            dim=int(c.get("dim", 3840)),
            n_layers=int(c.get("n_layers", 30)),
            n_refiner_layers=int(c.get("n_refiner_layers", 2)),
            n_heads=heads,
            norm_eps=float(c.get("norm_eps", 1e-5)),
            cap_feat_dim=int(c.get("cap_feat_dim", 2560)),
            rope_theta=float(c.get("rope_theta", 256.0)),
            t_scale=float(c.get("t_scale", 1000.0)),
            axes_dims=tuple(c.get("axes_dims", (32, 48, 48))),
            axes_lens=tuple(c.get("axes_lens", (1024, 512, 512))),
        )

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ZImageConfig:
        return cls(**{k: (tuple(v) if k in ("axes_dims", "axes_lens") else v) for k, v in data.items()})
