"""The architecture of a Wan VAE (2.1 and 2.2) as a frozen config with diffusers' argument names.

One dataclass covers every configuration diffusers' ``AutoencoderKLWan`` builds
(``src/diffusers/models/autoencoders/autoencoder_kl_wan.py``): Wan 2.1's VAE (``wan/modules/vae.py``:
4x8x8 compression, 16 latent channels, plain residual stacks) and Wan 2.2's (``wan/modules/vae2_2.py``:
``is_residual=True``, pixels patchified 2x2 into 12 channels, 4x16x16 compression, 48 latent channels,
a separate decoder width). Rules follow diffusers, not a stricter reading of it:

- widths may be odd (diffusers' own tests build ``base_dim=3``): a Wan 2.1 upsampler maps ``C`` to
  ``C // 2`` channels and the next level starts from ``C // 2``, floor division both places;
- ``attn_scales`` adds attention blocks to the *encoder* of a Wan 2.1 VAE (diffusers' decoder and the
  residual encoder ignore the list);
- the encoder reads ``temperal_downsample[:levels - 1]`` and the decoder the first ``levels - 1`` entries
  of the *reversed full* list, so a list longer than needed is accepted as diffusers accepts it;
- ``latents_mean``/``latents_std`` are only checked where they are used (the normalisation), as
  diffusers keeps its 16 default values whatever ``z_dim`` is;
- a residual VAE's shortcut widths must divide as diffusers' ``AvgDown3D``/``DupUp3D`` require (it
  refuses those configurations too).

``scale_factor_spatial``/``scale_factor_temporal`` are kept for the round trip; the factors that follow
from the architecture are :attr:`WanVAEConfig.spatial_factor` and :attr:`WanVAEConfig.temporal_factor`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

__all__ = [
    "ENCODE_CHUNK",
    "WAN21_LATENTS_MEAN",
    "WAN21_LATENTS_STD",
    "WAN22_LATENTS_MEAN",
    "WAN22_LATENTS_STD",
    "WanVAEConfig",
]

#: Per-channel latent statistics of the Wan 2.1 VAE (``WanVAE.mean`` / ``.std`` in the original).
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip
#: The Wan 2.2 VAE's 48 (``Wan2_2_VAE`` in ``wan/modules/vae2_2.py``; diffusers' converted config).
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip

#: Frames per encoder chunk after the first frame (diffusers and both originals hard-code 4).
ENCODE_CHUNK = 4


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
    """Architecture of a Wan VAE (diffusers ``AutoencoderKLWan`` argument names; module docstring)."""

    base_dim: int = 96
    decoder_base_dim: int | None = None  # None: base_dim
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)  # sic, the references' spelling
    dropout: float = 0.0  # training only; kept for the round trip
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    is_residual: bool = False
    in_channels: int = 3
    out_channels: int = 3
    patch_size: int | None = None
    scale_factor_temporal: int | None = 4
    scale_factor_spatial: int | None = 8

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "wan2.1-vae": {},
        "wan2.2-vae": dict(
            base_dim=160,
            decoder_base_dim=256,
            z_dim=48,
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
            scale_factor_temporal=4,
            latents_mean=WAN22_LATENTS_MEAN,
            latents_std=WAN22_LATENTS_STD,
        ),
    }

    def __post_init__(self) -> None:
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "temperal_downsample", tuple(bool(t) for t in self.temperal_downsample))
        object.__setattr__(self, "attn_scales", tuple(float(s) for s in self.attn_scales))
        object.__setattr__(self, "is_residual", bool(self.is_residual))
        for name in ("base_dim", "z_dim", "in_channels", "out_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"WanVAEConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.decoder_base_dim is not None and self.decoder_base_dim < 1:
            raise ValueError(f"WanVAEConfig.decoder_base_dim must be >= 1, got {self.decoder_base_dim}")
        if self.num_res_blocks < 0:
            raise ValueError(f"WanVAEConfig.num_res_blocks must be >= 0, got {self.num_res_blocks}")
        if self.patch_size is not None and self.patch_size < 1:
            raise ValueError(f"WanVAEConfig.patch_size must be >= 1 or None, got {self.patch_size}")
        if not self.dim_mult or min(self.dim_mult) < 1:
            raise ValueError(f"dim_mult must be one or more positive ints, got {self.dim_mult}")
        if len(self.temperal_downsample) < self.levels - 1:
            raise ValueError(
                f"temperal_downsample needs at least {self.levels - 1} entries (one per downsampling of "
                f"dim_mult={self.dim_mult}), got {self.temperal_downsample}"
            )
        if self.is_residual:
            self._check_residual_shortcuts()
        else:
            for i, width in enumerate(self.decoder_dims()[1:-1]):
                if width < 2:
                    raise ValueError(
                        f"decoder level {i} is {width} channel(s) wide: its upsampler would halve it to "
                        f"{width // 2}; make base_dim or decoder_base_dim larger"
                    )

    def _check_residual_shortcuts(self) -> None:
        """diffusers' AvgDown3D / DupUp3D need whole channel groups (it refuses these configs too)."""
        enc, dec = self.encoder_dims(), self.decoder_dims()
        for i, (c_in, c_out) in enumerate(zip(enc[:-1], enc[1:], strict=True)):
            factor = self.down_factors(i)
            if c_in * factor[0] * factor[1] ** 2 % c_out:
                raise ValueError(
                    f"encoder level {i}: {c_in} channels x {factor[0] * factor[1] ** 2} (the avg-down "
                    f"shortcut's factor) do not split into {c_out} groups"
                )
        for i, (c_in, c_out) in enumerate(zip(dec[:-1], dec[1:], strict=True)):
            if i == self.levels - 1:
                continue
            ft = 2 if self.decoder_temporal[i] else 1
            if c_out * ft * 4 % c_in:
                raise ValueError(
                    f"decoder level {i}: {c_out} channels x {ft * 4} (the dup-up shortcut's factor) "
                    f"are not a multiple of its {c_in} input channels"
                )

    # ------------------------------------------------------------------ derived structure
    @property
    def levels(self) -> int:
        return len(self.dim_mult)

    @property
    def patch(self) -> int:
        """Pixel patch (``patch_size``; 1 when None)."""
        return self.patch_size or 1

    @property
    def encoder_temporal(self) -> tuple[bool, ...]:
        """Which encoder levels halve time (diffusers reads ``temperal_downsample[i]`` for i < levels-1)."""
        return self.temperal_downsample[: self.levels - 1]

    @property
    def decoder_temporal(self) -> tuple[bool, ...]:
        """Which decoder levels double time: the reversed full list's first levels-1 entries."""
        return self.temperal_downsample[::-1][: self.levels - 1]

    @property
    def temporal_factor(self) -> int:
        """Frames per latent frame (after the first) on the encoder side."""
        return 2 ** sum(self.encoder_temporal)

    @property
    def decoder_temporal_factor(self) -> int:
        """Frames each latent frame after the first decodes to (equal to :attr:`temporal_factor` in every
        released VAE)."""
        return 2 ** sum(self.decoder_temporal)

    @property
    def spatial_factor(self) -> int:
        """Pixels per latent, per side: the patch times one 2x per level but the last."""
        return self.patch * 2 ** (self.levels - 1)

    @property
    def video_channels(self) -> int:
        """Channels of the video :meth:`~jaxdit.vae.wan_vae.WanVAE.encode` takes (before patchify)."""
        return self.in_channels // self.patch**2

    @property
    def output_channels(self) -> int:
        """Channels of the decoded video (after unpatchify)."""
        return self.out_channels // self.patch**2

    def down_factors(self, level: int) -> tuple[int, int]:
        """(time, space) factor of encoder level ``level``'s downsampling (1 on the last level)."""
        if level == self.levels - 1:
            return 1, 1
        return (2 if self.encoder_temporal[level] else 1), 2

    def decoder_dims(self) -> list[int]:
        base = self.decoder_base_dim or self.base_dim
        return [base * m for m in (self.dim_mult[-1], *self.dim_mult[::-1])]

    def encoder_dims(self) -> list[int]:
        return [self.base_dim * m for m in (1, *self.dim_mult)]

    # ------------------------------------------------------------------ presets and diffusers configs
    @classmethod
    def preset(cls, name: str = "wan2.1-vae") -> WanVAEConfig:
        """``wan2.1-vae``: Wan 2.1's VAE (126.9 M parameters); ``wan2.2-vae``: Wan 2.2's (TI2V-5B, 704.7 M)."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown Wan VAE preset {name!r}; known: {', '.join(sorted(cls.PRESETS))}")
        return cls(**cls.PRESETS[name])

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> WanVAEConfig:
        """From a diffusers ``AutoencoderKLWan`` ``config.json`` (a path or the parsed dict).

        Keys diffusers 0.42 does not take are ignored as it ignores them (e.g. ``clip_output``, written by
        earlier conversions of the Wan 2.2 VAE: 0.42 always clips the decoded video to [-1, 1]).
        """
        if not isinstance(config, Mapping):
            config = json.loads(Path(config).read_text(encoding="utf-8"))
        if config.get("_class_name") not in (None, "AutoencoderKLWan"):
            raise ValueError(f"config is for {config.get('_class_name')!r}, not AutoencoderKLWan")
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{k: config[k] for k in names if k in config and config[k] is not None})

    def to_diffusers(self) -> dict[str, Any]:
        """The diffusers ``config.json`` entries for this config."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {
            "_class_name": "AutoencoderKLWan",
            **{k: list(v) if isinstance(v, tuple) else v for k, v in out.items()},
        }

    def check_latent_stats(self) -> None:
        """Raise unless ``latents_mean``/``latents_std`` have one value per latent channel."""
        for name in ("latents_mean", "latents_std"):
            n = len(getattr(self, name))
            if n != self.z_dim:
                raise ValueError(
                    f"{name} has {n} values for z_dim={self.z_dim}: the latents cannot be normalised "
                    "(set the config's latents_mean/latents_std, one value per latent channel)"
                )
