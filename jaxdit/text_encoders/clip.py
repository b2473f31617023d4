"""CLIP text and vision transformers in Flax NNX: FLUX's CLIP-L text encoder, Wan I2V's ViT-H/14 image encoder.

Follows CLIP (Radford et al., arXiv 2103.00020) as transformers' ``CLIPTextModel`` and ``CLIPVisionModel``
implement it. Both are pre-norm transformers: x += out_proj(attention(LN1(x))); x += fc2(act(fc1(LN2(x)))),
with affine LayerNorms, biased projections and 1/sqrt(D)-scaled scores.

- Text: token + learned position embeddings, a causal mask, a final LayerNorm. The pooled output is the
  final hidden state at the end-of-text token, found as transformers 5 finds it: a config whose
  ``eos_token_id`` is 2 (the value older CLIP configs carry, FLUX.1's among them) takes the position of
  the largest token id (the end-of-text token has the highest id of the CLIP vocabulary); any other
  ``eos_token_id`` takes the first position holding that id. OpenAI's CLIP uses quick_gelu.
- Vision: the image is cut into patches by a stride-p convolution, done here as one matmul over
  [C, p, p] patches; a class embedding is prepended, learned positions added, then a LayerNorm before
  the blocks (``pre_layrnorm``). ``post_layernorm`` applies to the pooled class token only. Wan I2V takes
  the penultimate layer's hidden states (transformers' ``hidden_states[-2]``): :meth:`CLIPVisionModel.__call__`
  with ``hidden_layer=-2`` runs only the blocks it needs.

Blocks are stacked and run with ``lax.scan``. Shape letters: B batch, L tokens, H heads, D head_dim,
E hidden, F intermediate, C channels, p patch size.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdit.models.layers import Linear, layer_norm, param
from jaxdit.text_encoders.common import (
    MASKED,
    activation,
    attention,
    heads,
    read_json,
    scan_blocks,
    stack_blocks,
)

__all__ = [
    "CLIPTextConfig",
    "CLIPTextModel",
    "CLIPVisionConfig",
    "CLIPVisionModel",
    "abstract_text_model",
    "abstract_vision_model",
]

#: transformers' legacy marker: a CLIP text config with this eos_token_id pools at argmax(input_ids).
LEGACY_EOS_TOKEN_ID = 2


def _clip_section(config: Mapping[str, Any] | str | os.PathLike[str], part: str) -> dict[str, Any]:
    """The text or vision part of a CLIP config (a ``clip_{part}_model`` config, or a full ``clip`` one)."""
    c = dict(config) if isinstance(config, Mapping) else read_json(config)
    model_type = c.get("model_type")
    if model_type == "clip":
        return dict(c.get(f"{part}_config") or {})
    if model_type not in (f"clip_{part}_model", None):
        raise ValueError(f"config is for model_type {model_type!r}, not clip_{part}_model")
    return c


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """Hyper-parameters of a CLIP text transformer (transformers' ``CLIPTextConfig`` names)."""

    vocab_size: int = 49408
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = LEGACY_EOS_TOKEN_ID

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # openai/clip-vit-large-patch14 text tower: FLUX.1's text_encoder (its config keeps eos_token_id 2).
        "clip-vit-large-patch14": {},
    }

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"CLIPTextConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        activation(self.hidden_act)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> CLIPTextConfig:
        if name not in cls.PRESETS:
            raise ValueError(f"unknown CLIP text preset {name!r}; known: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> CLIPTextConfig:
        """From a transformers ``CLIPTextConfig`` (or ``CLIPConfig``) ``config.json``, a path or a dict."""
        c = _clip_section(config, "text")
        d = cls()
        return cls(
            vocab_size=int(c.get("vocab_size", d.vocab_size)),
            hidden_size=int(c.get("hidden_size", d.hidden_size)),
            intermediate_size=int(c.get("intermediate_size", d.intermediate_size)),
            num_hidden_layers=int(c.get("num_hidden_layers", d.num_hidden_layers)),
            num_attention_heads=int(c.get("num_attention_heads", d.num_attention_heads)),
            max_position_embeddings=int(c.get("max_position_embeddings", d.max_position_embeddings)),
            hidden_act=str(c.get("hidden_act", d.hidden_act)),
            layer_norm_eps=float(c.get("layer_norm_eps", d.layer_norm_eps)),
            # transformers' CLIPTextConfig defaults eos_token_id to 49407 when the file has none.
            eos_token_id=int(c.get("eos_token_id", 49407)),
        )


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    """Hyper-parameters of a CLIP vision transformer (transformers' ``CLIPVisionConfig`` names)."""

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 14
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # open_clip ViT-H/14 (laion2B) as transformers' CLIPVisionModel: Wan 2.1 I2V's image_encoder.
        "clip-vit-huge-14": {},
        # openai/clip-vit-large-patch14 vision tower.
        "clip-vit-large-patch14": {
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "hidden_act": "quick_gelu",
        },
    }

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "patch_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"CLIPVisionConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.image_size % self.patch_size:
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
    def preset(cls, name: str, **overrides: Any) -> CLIPVisionConfig:
        if name not in cls.PRESETS:
            raise ValueError(f"unknown CLIP vision preset {name!r}; known: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> CLIPVisionConfig:
        """From a transformers ``CLIPVisionConfig`` (or ``CLIPConfig``) ``config.json``, a path or a dict."""
        c = _clip_section(config, "vision")
        d = CLIPVisionConfig(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=224,
            patch_size=32,
            hidden_act="quick_gelu",
        )  # transformers' defaults (clip-vit-base-patch32)
        return cls(
            hidden_size=int(c.get("hidden_size", d.hidden_size)),
            intermediate_size=int(c.get("intermediate_size", d.intermediate_size)),
            num_hidden_layers=int(c.get("num_hidden_layers", d.num_hidden_layers)),
            num_attention_heads=int(c.get("num_attention_heads", d.num_attention_heads)),
            num_channels=int(c.get("num_channels", d.num_channels)),
            image_size=int(c.get("image_size", d.image_size)),
            patch_size=int(c.get("patch_size", d.patch_size)),
            hidden_act=str(c.get("hidden_act", d.hidden_act)),
            layer_norm_eps=float(c.get("layer_norm_eps", d.layer_norm_eps)),
        )


# --------------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------------


class LayerNorm(nnx.Module):
    """Affine LayerNorm, computed in fp32 (returns fp32)."""

    def __init__(self, dim: int, eps: float, *, dtype: Any, rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), ("embed",), dtype, init="ones")
        self.bias = param(rngs, (dim,), ("embed",), dtype, init="zeros")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.eps) * self.scale[...].astype(jnp.float32) + self.bias[...].astype(
            jnp.float32
        )


class EncoderLayer(nnx.Module):
    """One pre-norm CLIP block (transformers' ``CLIPEncoderLayer``)."""

    def __init__(self, cfg: CLIPTextConfig | CLIPVisionConfig, *, dtype: Any, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.layer_norm1 = LayerNorm(e, cfg.layer_norm_eps, dtype=dtype, rngs=rngs)
        self.q_proj = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.k_proj = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.v_proj = Linear(e, e, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.out_proj = Linear(e, e, ("heads", "embed"), rngs=rngs, dtype=dtype)
        self.layer_norm2 = LayerNorm(e, cfg.layer_norm_eps, dtype=dtype, rngs=rngs)
        self.fc1 = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.fc2 = Linear(f, e, ("mlp", "embed"), rngs=rngs, dtype=dtype)
        self.head_dim = cfg.head_dim
        self.act = cfg.hidden_act

    def __call__(self, x: jax.Array, bias: jax.Array | None) -> jax.Array:
        """x [B, L, E] fp32 residual stream; bias broadcastable to [B, H, L, L] or None."""
        dtype = self.q_proj.kernel.dtype
        h = self.layer_norm1(x).astype(dtype)
        q, k, v = (heads(p(h), self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        x = x + self.out_proj(attention(q, k, v, bias, self.head_dim**-0.5)).astype(jnp.float32)
        h = self.layer_norm2(x).astype(dtype)
        h = activation(self.act)(self.fc1(h).astype(jnp.float32)).astype(dtype)
        return x + self.fc2(h).astype(jnp.float32)


class CLIPTextModel(nnx.Module):
    """CLIP text transformer: ids [B, L] -> (last hidden state [B, L, E], pooled [B, E]), both fp32."""

    def __init__(self, config: CLIPTextConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        cfg = config
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.token_embedding = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.position_embedding = param(
            rngs, (cfg.max_position_embeddings, cfg.hidden_size), ("positions", "embed"), dtype
        )
        self.blocks = stack_blocks(
            lambda r: EncoderLayer(cfg, dtype=dtype, rngs=r), cfg.num_hidden_layers, rngs
        )
        self.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype, rngs=rngs)

    def pooled_positions(self, input_ids: jax.Array) -> jax.Array:
        """[B] index of the end-of-text token in each row (see the module docstring)."""
        if self.config.eos_token_id == LEGACY_EOS_TOKEN_ID:
            return jnp.argmax(input_ids, axis=-1)
        return jnp.argmax(input_ids == self.config.eos_token_id, axis=-1)

    def __call__(self, input_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        length = input_ids.shape[1]
        if length > self.config.max_position_embeddings:
            raise ValueError(
                f"{length} tokens, but the CLIP text model has {self.config.max_position_embeddings} positions"
            )
        x = self.token_embedding[...][input_ids].astype(jnp.float32)
        x = x + self.position_embedding[...][:length].astype(jnp.float32)
        causal = jnp.where(jnp.tril(jnp.ones((length, length), bool)), 0.0, MASKED)[None, None]
        x = scan_blocks(self.blocks, x, lambda block, c: block(c, causal))
        x = self.final_layer_norm(x)
        pooled = jnp.take_along_axis(x, self.pooled_positions(input_ids)[:, None, None], axis=1)[:, 0]
        return x, pooled


class CLIPVisionModel(nnx.Module):
    """CLIP vision transformer: pixels [B, C, H, W] (the image processor's NCHW) -> hidden states."""

    def __init__(self, config: CLIPVisionConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        cfg = config
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        e, p = cfg.hidden_size, cfg.patch_size
        self.class_embedding = param(rngs, (e,), ("embed",), dtype)
        # The stride-p convolution's weight [E, C, p, p] held as a matmul kernel [C, p, p, E].
        self.patch_embedding = param(rngs, (cfg.num_channels, p, p, e), (None, None, None, "embed"), dtype)
        self.position_embedding = param(rngs, (cfg.num_patches + 1, e), ("positions", "embed"), dtype)
        self.pre_layrnorm = LayerNorm(e, cfg.layer_norm_eps, dtype=dtype, rngs=rngs)
        self.blocks = stack_blocks(
            lambda r: EncoderLayer(cfg, dtype=dtype, rngs=r), cfg.num_hidden_layers, rngs
        )
        self.post_layernorm = LayerNorm(e, cfg.layer_norm_eps, dtype=dtype, rngs=rngs)

    def embed(self, pixel_values: jax.Array) -> jax.Array:
        """[B, C, H, W] -> [B, 1 + N, E] fp32, after ``pre_layrnorm`` (transformers' ``hidden_states[0]``)."""
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
        x = x.reshape(b, -1, cfg.hidden_size)
        cls = jnp.broadcast_to(self.class_embedding[...].astype(jnp.float32), (b, 1, cfg.hidden_size))
        x = jnp.concatenate([cls, x], axis=1) + self.position_embedding[...].astype(jnp.float32)
        return self.pre_layrnorm(x)

    def __call__(self, pixel_values: jax.Array, *, hidden_layer: int = -1) -> jax.Array:
        """transformers' ``hidden_states[hidden_layer]`` [B, 1 + N, E] fp32: index 0 is the embedding, i the
        output of block i; -1 the last block's (no ``post_layernorm``), -2 the penultimate (Wan I2V)."""
        n = self.config.num_hidden_layers
        run = hidden_layer + n + 1 if hidden_layer < 0 else hidden_layer
        if not 0 <= run <= n:
            raise ValueError(f"hidden_layer {hidden_layer} out of range for {n} blocks")
        x = self.embed(pixel_values)
        if run == 0:
            return x
        return scan_blocks(self.blocks, x, lambda block, c: block(c, None), first=run)

    def pooled(self, pixel_values: jax.Array) -> jax.Array:
        """transformers' ``pooler_output``: ``post_layernorm`` of the last block's class token, [B, E]."""
        return self.post_layernorm(self(pixel_values)[:, 0])


def abstract_text_model(config: CLIPTextConfig, dtype: Any = jnp.float32) -> CLIPTextModel:
    return nnx.eval_shape(lambda: CLIPTextModel(config, dtype=dtype, rngs=nnx.Rngs(0)))


def abstract_vision_model(config: CLIPVisionConfig, dtype: Any = jnp.float32) -> CLIPVisionModel:
    return nnx.eval_shape(lambda: CLIPVisionModel(config, dtype=dtype, rngs=nnx.Rngs(0)))
