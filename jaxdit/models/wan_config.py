"""The architecture of a Wan transformer (Wan 2.1 T2V / I2V, Wan 2.2 A14B experts and TI2V-5B), as data.

One frozen dataclass covers every released Wan transformer: Wan 2.2 reuses Wan 2.1's blocks unchanged
(``wan/modules/model.py`` of Wan-Video/Wan2.2; diffusers' ``WanTransformer3DModel`` runs all of them), so
the variants differ only in sizes and inputs:

- T2V: ``in_channels == out_channels`` (16 latent channels of the Wan 2.1 VAE; 48 of the Wan 2.2 VAE for
  TI2V-5B).
- Image-to-video by channel concatenation: ``in_channels = out_channels + 4 mask + 16 condition latent``
  (36). Wan 2.1 I2V also attends to CLIP image features (``image_dim``, separate image K/V in every
  block); Wan 2.2 I2V-A14B has no CLIP image encoder (``image_dim`` None).
- TI2V-5B conditions on an image without extra channels: the pipeline replaces the first latent frame
  and gives its tokens timestep 0 (``jaxdit.pipelines.wan``); the architecture is plain T2V.

The A14B models are two transformers of Wan2.1-14B's shape (a high-noise and a low-noise expert): two
checkpoints of one config, which the pipeline switches between.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

__all__ = ["VAE_FACTORS", "WanConfig"]

#: (temporal, spatial) compression of the VAE whose latents a transformer denoises, by latent channels:
#: the Wan 2.1 VAE (16 channels, 4 x 8 x 8) and the Wan 2.2 VAE (48 channels, 4 x 16 x 16). The latent
#: width names the VAE: every released Wan transformer pairs with exactly one of the two.
VAE_FACTORS = {16: (4, 8), 48: (4, 16)}


#: Blocks a config may ask for: far above any released model (Wan 2.1 14B: 40).
MAX_BLOCKS = 1000


@dataclasses.dataclass(frozen=True)
class WanConfig:
    """Architecture of one Wan transformer (``WanModel`` arguments, diffusers names in comments)."""

    dim: int = 1536  # num_attention_heads * attention_head_dim
    ffn_dim: int = 8960
    num_heads: int = 12  # num_attention_heads
    num_layers: int = 30
    in_channels: int = 16  # 36 for I2V: [noise 16 | mask 4 | condition latent 16]; 48 for TI2V-5B
    out_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 4096
    freq_dim: int = 256
    eps: float = 1e-6
    #: CLIP feature width (1280) for Wan 2.1 I2V; None otherwise. Implies image keys/values in every block.
    image_dim: int | None = None
    rope_theta: float = 10000.0

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "wan2.1-t2v-1.3b": dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30, in_channels=16),
        "wan2.1-t2v-14b": dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40, in_channels=16),
        "wan2.1-i2v-14b": dict(
            dim=5120, ffn_dim=13824, num_heads=40, num_layers=40, in_channels=36, image_dim=1280
        ),
        # Each of the two experts (Wan2.2 repository wan/configs/wan_{t2v,i2v}_A14B.py).
        "wan2.2-t2v-a14b": dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40, in_channels=16),
        "wan2.2-i2v-a14b": dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40, in_channels=36),
        # wan/configs/wan_ti2v_5B.py: the Wan 2.2 VAE's 48 latent channels in and out.
        "wan2.2-ti2v-5b": dict(
            dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_channels=48, out_channels=48
        ),
    }

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"patch_size must be three positive ints (t, h, w), got {self.patch_size}")
        for name in ("dim", "ffn_dim", "num_heads", "num_layers", "in_channels", "out_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"WanConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_layers > MAX_BLOCKS:  # Wan 2.1 14B has 40; a typo would take minutes of building
            raise ValueError(f"WanConfig.num_layers {self.num_layers} is beyond {MAX_BLOCKS} blocks")
        if self.dim % self.num_heads:
            raise ValueError(f"dim={self.dim} is not a multiple of num_heads={self.num_heads}")
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(f"head_dim={self.head_dim} must be even and >= 6 for the 3D RoPE split")
        if self.image_dim is not None and self.image_dim < 1:
            raise ValueError(f"image_dim must be None or >= 1, got {self.image_dim}")

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def rope_axes_dim(self) -> tuple[int, int, int]:
        """Head dims rotated by (frame, row, col): d - 4(d//6), 2(d//6), 2(d//6) (44/42/42 for d=128)."""
        d = self.head_dim
        return (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))

    @property
    def patch_features(self) -> int:
        return self.in_channels * math.prod(self.patch_size)

    @property
    def out_features(self) -> int:
        return self.out_channels * math.prod(self.patch_size)

    @property
    def is_i2v(self) -> bool:
        """Whether the model attends to CLIP image features (Wan 2.1 I2V): ``image_dim`` is set."""
        return self.image_dim is not None

    @property
    def condition_channels(self) -> int:
        """Channels read beside the noise (I2V's 4 mask + 16 condition latent; 0 for T2V and TI2V)."""
        return self.in_channels - self.out_channels

    @property
    def vae_factors(self) -> tuple[int, int]:
        """(temporal, spatial) compression of the VAE this model's latents come from (:data:`VAE_FACTORS`;
        Wan 2.1's 4 x 8 for latent widths no released VAE has, as the tests' tiny models)."""
        return VAE_FACTORS.get(self.out_channels, VAE_FACTORS[16])

    # ------------------------------------------------------------------ builders
    @classmethod
    def preset(cls, name: str) -> WanConfig:
        """One of :attr:`PRESETS` (``wan2.1-t2v-14b``, ``wan2.2-ti2v-5b``, ...)."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown Wan preset {name!r}; known: {', '.join(sorted(cls.PRESETS))}")
        return cls(**cls.PRESETS[name])

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> WanConfig:
        """From a diffusers ``WanTransformer3DModel`` ``config.json`` (a path or the parsed dict)."""
        if not isinstance(config, Mapping):
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        if config.get("_class_name") not in (None, "WanTransformer3DModel"):
            raise ValueError(f"config is for {config.get('_class_name')!r}, not WanTransformer3DModel")
        get = lambda k, d: config.get(k, d) if config.get(k, d) is not None else d
        heads, head_dim = int(get("num_attention_heads", 40)), int(get("attention_head_dim", 128))
        dim = heads * head_dim
        if get("qk_norm", "rms_norm_across_heads") != "rms_norm_across_heads":
            raise ValueError(f"only qk_norm='rms_norm_across_heads' exists in Wan, got {config['qk_norm']!r}")
        if not get("cross_attn_norm", True):
            raise ValueError("cross_attn_norm=False is not a Wan configuration")
        if config.get("pos_embed_seq_len") is not None:
            raise ValueError("pos_embed_seq_len is set: FLF2V (first-last-frame) models are not supported")
        image_dim, added_kv = config.get("image_dim"), config.get("added_kv_proj_dim")
        if (image_dim is None) != (added_kv is None):
            raise ValueError(
                f"image_dim={image_dim} and added_kv_proj_dim={added_kv}: Wan 2.1 I2V sets both "
                f"(added_kv_proj_dim = {dim}), other Wan models neither; other combinations are not Wan"
            )
        if added_kv is not None and int(added_kv) != dim:
            raise ValueError(f"added_kv_proj_dim={added_kv} must equal the hidden size {dim}")
        in_channels = int(get("in_channels", 16))
        return cls(
            dim=dim,
            ffn_dim=int(get("ffn_dim", 13824)),
            num_heads=heads,
            num_layers=int(get("num_layers", 40)),
            in_channels=in_channels,
            out_channels=int(get("out_channels", in_channels)),
            patch_size=tuple(get("patch_size", (1, 2, 2))),
            text_dim=int(get("text_dim", 4096)),
            freq_dim=int(get("freq_dim", 256)),
            eps=float(get("eps", 1e-6)),
            image_dim=None if image_dim is None else int(image_dim),
        )

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WanConfig:
        return cls(**{k: (tuple(v) if k == "patch_size" else v) for k, v in data.items()})

    @classmethod
    def from_original(cls, config: Mapping[str, Any]) -> WanConfig:
        """From the original repositories' ``config.json`` (``WanModel`` arguments: dim, num_heads, ...).

        The file does not say whether an ``i2v`` model has Wan 2.1's CLIP image path (Wan 2.2's I2V-A14B
        has the same fields without it): ``image_dim`` is 1280 for ``i2v`` unless the file sets it (files
        jaxdit writes do); ``converters.wan.detect`` settles it from the checkpoint's keys.
        """
        model_type = config.get("model_type", "t2v")
        if model_type not in ("t2v", "i2v", "ti2v"):
            raise ValueError(f"model_type={model_type!r}: only Wan t2v, i2v and ti2v models are supported")
        in_dim = int(config.get("in_dim", 36 if model_type == "i2v" else 16))
        image_dim = config.get("image_dim", 1280 if model_type == "i2v" else None)
        return cls(
            dim=int(config["dim"]),
            ffn_dim=int(config["ffn_dim"]),
            num_heads=int(config["num_heads"]),
            num_layers=int(config["num_layers"]),
            in_channels=in_dim,
            out_channels=int(config.get("out_dim", 16)),
            patch_size=tuple(config.get("patch_size", (1, 2, 2))),
            text_dim=int(config.get("text_dim", 4096)),
            freq_dim=int(config.get("freq_dim", 256)),
            eps=float(config.get("eps", 1e-6)),
            image_dim=None if image_dim is None else int(image_dim),
        )

    @classmethod
    def from_original_keys(
        cls, shapes: Mapping[str, Sequence[int]], num_heads: int | None = None
    ) -> WanConfig:
        """Infer the architecture from original-layout tensor names and shapes.

        Shapes fix everything except the head count; every Wan release uses head_dim 128, so
        ``num_heads`` defaults to dim // 128 (pass it, or use a config.json, for other models).
        """

        def shape(key: str) -> tuple[int, ...]:
            if key not in shapes:
                raise KeyError(f"cannot infer the Wan architecture: the checkpoint has no {key!r}")
            return tuple(int(s) for s in shapes[key])

        dim, in_channels, *patch = shape("patch_embedding.weight")
        layers = {
            int(k.split(".")[1]) for k in shapes if k.startswith("blocks.") and k.endswith(".modulation")
        }
        if not layers or sorted(layers) != list(range(len(layers))):
            raise KeyError(
                f"cannot infer the Wan architecture: block indices {sorted(layers)} are not 0..N-1"
            )
        if num_heads is None:
            if dim % 128:
                raise ValueError(f"dim={dim} is not a multiple of 128; pass num_heads (or a config.json)")
            num_heads = dim // 128
        image_dim = shape("img_emb.proj.0.weight")[0] if "img_emb.proj.0.weight" in shapes else None
        return cls(
            dim=dim,
            ffn_dim=shape("blocks.0.ffn.0.weight")[0],
            num_heads=num_heads,
            num_layers=len(layers),
            in_channels=in_channels,
            out_channels=shape("head.head.weight")[0] // math.prod(patch),
            patch_size=tuple(patch),
            text_dim=shape("text_embedding.0.weight")[1],
            freq_dim=shape("time_embedding.0.weight")[1],
            image_dim=image_dim,
        )
