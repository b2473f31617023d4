"""The SigLIP vision transformer in Flax NNX: HunyuanVideo 1.5 I2V's image encoder.

Follows SigLIP (Zhai et al., arXiv 2303.15343) as transformers' ``SiglipVisionModel`` implements it: the
image is cut into patches by a biased stride-p convolution (done here as one matmul over [C, p, p]
patches), learnt positions are added (no class token, no LayerNorm before the blocks), then pre-norm
blocks of CLIP's shape (``clip.EncoderLayer``: affine LayerNorms, biased projections, 1/sqrt(D) scores,
SigLIP's tanh-approximated GELU) and ``post_layernorm`` over every token: transformers'
``last_hidden_state``, which HunyuanVideo 1.5 reads. The attention-pooling head (``pooler_output``) is
not computed: no pipeline here reads it.

Shape letters: B batch, N patches, E hidden, C channels, p patch size.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.models.layers import param
from jaxdit.text_encoders.clip import EncoderLayer, LayerNorm
from jaxdit.text_encoders.common import activation, read_json, scan_blocks, stack_blocks

__all__ = ["SiglipVisionConfig", "SiglipVisionModel", "abstract_vision_model"]


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig:
    """Hyper-parameters of a SigLIP vision transformer (transformers' ``SiglipVisionConfig`` names and
    defaults; HunyuanVideo 1.5 I2V's is so400m-patch14-384: 1152 wide, 27 layers, 729 tokens)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"SiglipVisionConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.patch_size < 1 or self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )
        activation(self.hidden_act)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> SiglipVisionConfig:
        """From a transformers ``SiglipVisionConfig`` ``config.json`` (or a ``SiglipConfig``'s vision part)."""
        c = dict(config) if isinstance(config, Mapping) else read_json(config)
        if c.get("model_type") == "siglip":
            c = dict(c.get("vision_config") or {})
        elif c.get("model_type") not in ("siglip_vision_model", None):
            raise ValueError(f"config is for model_type {c.get('model_type')!r}, not siglip_vision_model")
        known = {f.name: f.type for f in dataclasses.fields(cls)}
        return cls(**{k: type(getattr(cls(), k))(v) for k, v in c.items() if k in known})


class SiglipVisionModel(nnx.Module):
    """SigLIP vision transformer: pixels [B, C, S, S] (the image processor's NCHW) -> last hidden state
    [B, N, E] fp32."""

    def __init__(self, config: SiglipVisionConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        cfg = config
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        e, p = cfg.hidden_size, cfg.patch_size
        # The stride-p convolution's weight [E, C, p, p] held as a matmul kernel [C, p, p, E].
        self.patch_embedding = param(rngs, (cfg.num_channels, p, p, e), (None, None, None, "embed"), dtype)
        self.patch_bias = param(rngs, (e,), ("embed",), dtype, init="zeros")
        self.position_embedding = param(rngs, (cfg.num_patches, e), ("positions", "embed"), dtype)
        self.blocks = stack_blocks(
            lambda r: EncoderLayer(cfg, dtype=dtype, rngs=r), cfg.num_hidden_layers, rngs
        )
        self.post_layernorm = LayerNorm(e, cfg.layer_norm_eps, dtype=dtype, rngs=rngs)

    def embed(self, pixel_values: jax.Array) -> jax.Array:
        """[B, C, S, S] -> [B, N, E] fp32: patches (row-major, as the convolution's output flattens) plus
        positions."""
        cfg = self.config
        b, c, h, w = pixel_values.shape
        if (c, h, w) != (cfg.num_channels, cfg.image_size, cfg.image_size):
            raise ValueError(
                f"pixel_values of shape {pixel_values.shape}; the model takes "
                f"[B, {cfg.num_channels}, {cfg.image_size}, {cfg.image_size}]"
            )
        p = cfg.patch_size
        kernel = self.patch_embedding[...]
        patches = pixel_values.astype(kernel.dtype).reshape(b, c, h // p, p, w // p, p)
        x = jnp.einsum("bcyixj,cije->byxe", patches, kernel, preferred_element_type=jnp.float32)
        x = x.reshape(b, -1, cfg.hidden_size) + self.patch_bias[...].astype(jnp.float32)
        return x + self.position_embedding[...].astype(jnp.float32)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """transformers' ``last_hidden_state``: ``post_layernorm`` of the last block's output."""
        x = scan_blocks(self.blocks, self.embed(pixel_values), lambda block, c: block(c, None))
        return self.post_layernorm(x)


def abstract_vision_model(config: SiglipVisionConfig, dtype: Any = jnp.float32) -> SiglipVisionModel:
    return nnx.eval_shape(lambda: SiglipVisionModel(config, dtype=dtype, rngs=nnx.Rngs(0)))
