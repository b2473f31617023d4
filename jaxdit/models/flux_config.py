"""FLUX.1's transformer config: widths, depths, RoPE split, guidance embedding; its presets and the
diffusers / BFL config files it is read from."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar

#: Token groups of the joint sequence, in the order every shard holds them. The image stream carries
#: every group after the text: the denoised image, then (Kontext) the clean reference tokens.
TEXT, IMAGE, REFERENCE = 0, 1, 2
#: Blocks per stack a config may ask for: far above any released model (FLUX.1: 19 + 38); a config
#: asking for more is a typo that would otherwise cost minutes of building before a shape error.
MAX_BLOCKS = 1000

# --------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FluxConfig:
    """Hyper-parameters of a FLUX.1 transformer (BFL's ``FluxParams`` names)."""

    in_channels: int = 64
    out_channels: int = 64  # features per output token (diffusers: patch_size**2 * out_channels)
    vec_in_dim: int = 768  # CLIP-L pooled embedding
    context_in_dim: int = 4096  # T5-XXL token embedding
    hidden_size: int = 3072
    num_heads: int = 24
    depth: int = 19  # double-stream blocks
    depth_single_blocks: int = 38
    mlp_ratio: float = 4.0
    axes_dim: tuple[int, ...] = (16, 56, 56)  # RoPE dims of (index, row, col); sums to head_dim
    theta: float = 10000.0
    qkv_bias: bool = True
    guidance_embed: bool = False  # dev: True (distilled guidance input), schnell: False

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "flux-dev": {"guidance_embed": True},
        "flux-schnell": {"guidance_embed": False},
    }

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dim", tuple(int(a) for a in self.axes_dim))
        for name in (
            "in_channels",
            "out_channels",
            "vec_in_dim",
            "context_in_dim",
            "hidden_size",
            "num_heads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"FluxConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.depth < 0 or self.depth_single_blocks < 0:
            raise ValueError(f"negative depth: {self.depth} double, {self.depth_single_blocks} single blocks")
        # FLUX.1 has 19 and 38; a typo would take minutes of building before a shape error.
        for name, key in (("depth", "num_layers"), ("depth_single_blocks", "num_single_layers")):
            if getattr(self, name) > MAX_BLOCKS:
                raise ValueError(
                    f"FluxConfig.{name} (diffusers' {key}) {getattr(self, name)} is beyond {MAX_BLOCKS} blocks"
                )
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if sum(self.axes_dim) != self.head_dim or any(a % 2 for a in self.axes_dim):
            raise ValueError(
                f"RoPE axes_dim {self.axes_dim} must be even and sum to head_dim "
                f"{self.hidden_size} / {self.num_heads} = {self.head_dim}"
            )
        if self.mlp_hidden < 1:
            raise ValueError(f"mlp_ratio {self.mlp_ratio} gives an empty MLP")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> FluxConfig:
        """``"flux-dev"`` or ``"flux-schnell"`` (full size), optionally with fields overridden."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown FLUX preset {name!r}; known: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> FluxConfig:
        """From a diffusers ``FluxTransformer2DModel`` ``config.json`` (a path or the parsed dict)."""
        if not isinstance(config, Mapping):
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        c = dict(config)
        known = {"FluxTransformer2DModel", None}
        if c.get("_class_name") not in known:
            raise ValueError(f"config is for {c.get('_class_name')!r}, not FluxTransformer2DModel")
        patch = int(c.get("patch_size", 1))
        if patch < 1:
            raise ValueError(f"config.json: patch_size must be >= 1, got {patch}")
        heads = int(c.get("num_attention_heads", 24))
        head_dim = int(c.get("attention_head_dim", 128))
        in_channels = int(c.get("in_channels", 64))
        out_channels = c.get("out_channels") or in_channels
        return cls(
            in_channels=in_channels,
            out_channels=patch * patch * int(out_channels),
            vec_in_dim=int(c.get("pooled_projection_dim", 768)),
            context_in_dim=int(c.get("joint_attention_dim", 4096)),
            hidden_size=heads * head_dim,
            num_heads=heads,
            depth=int(c.get("num_layers", 19)),
            depth_single_blocks=int(c.get("num_single_layers", 38)),
            axes_dim=tuple(c.get("axes_dims_rope", (16, 56, 56))),
            guidance_embed=bool(c.get("guidance_embeds", False)),
            # diffusers fixes the MLP ratio at 4; a jaxdit-written config may carry another one.
            mlp_ratio=float(c.get("mlp_ratio", 4.0)),
        )

    @classmethod
    def from_bfl_keys(cls, shapes: Mapping[str, tuple[int, ...]], **overrides: Any) -> FluxConfig:
        """Inferred from a BFL state dict's key -> shape map (keys without any ``model.diffusion_model.``
        prefix), as BFL's and diffusers' single-file loaders do.

        The RoPE split is not stored in the weights: it is FLUX.1's (16, 56, 56) for head_dim 128 and must
        be passed as ``axes_dim=`` otherwise.
        """

        def shape(key: str) -> tuple[int, ...]:
            if key not in shapes:
                raise KeyError(f"cannot infer the FLUX config: no tensor {key!r}")
            return tuple(shapes[key])

        def count(prefix: str) -> int:
            idx = {int(k[len(prefix) :].split(".", 1)[0]) for k in shapes if k.startswith(prefix)}
            return max(idx) + 1 if idx else 0

        hidden, in_channels = shape("img_in.weight")
        depth = count("double_blocks.")
        norm_key = (
            "double_blocks.0.img_attn.norm.query_norm.scale"
            if depth
            else "single_blocks.0.norm.query_norm.scale"
        )
        head_dim = shape(norm_key)[0]
        mlp = (
            shape("double_blocks.0.img_mlp.0.weight")[0]
            if depth
            else shape("single_blocks.0.linear1.weight")[0] - 3 * hidden
        )
        fields: dict[str, Any] = dict(
            in_channels=in_channels,
            out_channels=shape("final_layer.linear.weight")[0],
            vec_in_dim=shape("vector_in.in_layer.weight")[1],
            context_in_dim=shape("txt_in.weight")[1],
            hidden_size=hidden,
            num_heads=hidden // head_dim,
            depth=depth,
            depth_single_blocks=count("single_blocks."),
            mlp_ratio=mlp / hidden,
            qkv_bias=(not depth) or "double_blocks.0.img_attn.qkv.bias" in shapes,
            guidance_embed="guidance_in.in_layer.weight" in shapes,
        )
        fields.update(overrides)
        if "axes_dim" not in fields:
            if head_dim != 128:
                raise ValueError(
                    f"head_dim is {head_dim}: the RoPE axes split cannot be inferred from the weights "
                    "(FLUX.1 uses (16, 56, 56) for head_dim 128); pass axes_dim= or a config"
                )
            fields["axes_dim"] = (16, 56, 56)
        return cls(**fields)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FluxConfig:
        return cls(**{k: (tuple(v) if k == "axes_dim" else v) for k, v in data.items()})
