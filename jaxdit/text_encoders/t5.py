"""T5 v1.1 and umT5 encoders in Flax NNX: FLUX's T5-XXL and Wan 2.1's umT5-XXL.

Follows the T5 v1.1 encoder (Raffel et al., arXiv 1910.10683; v1.1 and its gated-GELU feed-forward from
Shazeer, arXiv 2002.05202) as transformers' ``T5EncoderModel`` implements it, and umT5 (Chung et al.,
arXiv 2304.09151; transformers' ``UMT5EncoderModel``, Wan's ``wan/modules/t5.py`` ``T5Encoder`` with
``shared_pos=False``). The one structural difference is :attr:`T5Config.per_layer_position_bias`: T5 learns
one relative position bias table (in layer 0) that every layer adds, umT5 one table per layer.

A block: x += o(attention(RMS(x))); x += wo(gelu_tanh(wi_0(RMS(x))) * wi_1(RMS(x))). The norm is T5's
scale-only RMS norm (no mean, no bias); scores are not scaled by 1/sqrt(D) (T5 folds that into the
initialisation); the relative position bias is bucketed bidirectionally (exact buckets for small
distances, log-spaced up to ``relative_attention_max_distance``). A final RMS norm ends the stack.

Parameters are named after transformers' modules (``q``, ``k``, ``v``, ``o``, ``wi_0``, ``wi_1``,
``wo``); ``converters/t5.py`` maps the HF and Wan checkpoints onto them. Blocks are stacked and run with
``lax.scan``, so compile time does not depend on depth.

Shape letters: B batch, L tokens, H heads, D head_dim (``d_kv``), E ``d_model``, F ``d_ff``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdit.models.layers import Linear, param, rms_norm
from jaxdit.text_encoders.common import (
    MASKED,
    activation,
    attention,
    heads,
    read_json,
    scan_blocks,
    stack_blocks,
)

__all__ = ["T5Config", "T5Encoder", "abstract_model", "relative_position_buckets"]


@dataclasses.dataclass(frozen=True)
class T5Config:
    """Hyper-parameters of a T5 v1.1 / umT5 encoder (transformers' ``T5Config`` names)."""

    vocab_size: int = 32128
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    dense_act_fn: str = "gelu_new"  # "gated-gelu" = gelu_new (tanh approximation) on the gate
    per_layer_position_bias: bool = False  # umT5: every layer has its own relative_attention_bias

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # google/t5-v1_1-xxl: FLUX.1's text_encoder_2.
        "t5-v1_1-xxl": {},
        # google/umt5-xxl: Wan 2.1's text encoder.
        "umt5-xxl": {"vocab_size": 256384, "per_layer_position_bias": True},
    }

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_heads", "relative_attention_num_buckets"):
            if getattr(self, name) < 1:
                raise ValueError(f"T5Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_layers < 1:
            raise ValueError(f"T5Config.num_layers must be >= 1, got {self.num_layers}")
        if self.relative_attention_num_buckets < 4:
            raise ValueError(
                f"relative_attention_num_buckets {self.relative_attention_num_buckets}: bidirectional "
                "bucketing needs at least 4"
            )
        activation(self.dense_act_fn)  # raises for an unknown name

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.d_kv

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> T5Config:
        """``"t5-v1_1-xxl"`` or ``"umt5-xxl"`` (full size), optionally with fields overridden."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown T5 preset {name!r}; known: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> T5Config:
        """From a transformers ``T5Config``/``UMT5Config`` ``config.json`` (a path or the parsed dict)."""
        c = dict(config) if isinstance(config, Mapping) else read_json(config)
        model_type = c.get("model_type", "t5")
        if model_type not in ("t5", "umt5"):
            raise ValueError(f"config is for model_type {model_type!r}, not t5 or umt5")
        proj = str(c.get("feed_forward_proj", "relu"))
        parts = proj.split("-")
        if parts[0] != "gated" or len(parts) != 2:
            raise ValueError(
                f"feed_forward_proj {proj!r}: only the gated feed-forward of T5 v1.1 / umT5 is supported"
            )
        act = "gelu_new" if parts[1] == "gelu" else parts[1]  # transformers' own special case
        return cls(
            vocab_size=int(c["vocab_size"]),
            d_model=int(c["d_model"]),
            d_kv=int(c["d_kv"]),
            d_ff=int(c["d_ff"]),
            num_layers=int(c["num_layers"]),
            num_heads=int(c["num_heads"]),
            relative_attention_num_buckets=int(c.get("relative_attention_num_buckets", 32)),
            relative_attention_max_distance=int(c.get("relative_attention_max_distance", 128)),
            layer_norm_epsilon=float(c.get("layer_norm_epsilon", 1e-6)),
            dense_act_fn=act,
            per_layer_position_bias=model_type == "umt5",
        )


def relative_position_buckets(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """Bidirectional T5 buckets of (key - query) for a [length, length] grid, as int32.

    Half the buckets are for keys after the query. Within a half, distances below ``n / 2`` get a bucket
    each and larger ones share log-spaced buckets up to ``max_distance`` (then the last bucket). Computed
    on the host in float32, the precision the reference computes the logarithm in, so bucket edges agree.
    """
    rel = np.arange(length)[None, :] - np.arange(length)[:, None]
    half = num_buckets // 2
    out = (rel > 0).astype(np.int64) * half
    dist = np.abs(rel)
    exact = half // 2
    ratio = np.maximum(dist, 1).astype(np.float32) / np.float32(exact)
    spread = np.log(ratio) / np.float32(math.log(max_distance / exact)) * np.float32(half - exact)
    large = np.minimum(exact + spread.astype(np.int64), half - 1)
    return (out + np.where(dist < exact, dist, large)).astype(np.int32)


def _position_bias(table: jax.Array, buckets: np.ndarray) -> jax.Array:
    """[buckets, H] table -> [1, H, L, L] fp32 bias."""
    return jnp.transpose(table.astype(jnp.float32)[jnp.asarray(buckets)], (2, 0, 1))[None]


class T5Block(nnx.Module):
    """Self-attention and gated feed-forward, each pre-normed with a residual."""

    def __init__(self, cfg: T5Config, *, dtype: Any, rngs: nnx.Rngs):
        e, inner, f = cfg.d_model, cfg.inner_dim, cfg.d_ff
        self.attn_norm = param(rngs, (e,), ("embed",), dtype, init="ones")
        self.q = Linear(e, inner, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=False)
        self.k = Linear(e, inner, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=False)
        self.v = Linear(e, inner, ("embed", "heads"), rngs=rngs, dtype=dtype, bias=False)
        self.o = Linear(inner, e, ("heads", "embed"), rngs=rngs, dtype=dtype, bias=False)
        self.ffn_norm = param(rngs, (e,), ("embed",), dtype, init="ones")
        self.wi_0 = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype, bias=False)
        self.wi_1 = Linear(e, f, ("embed", "mlp"), rngs=rngs, dtype=dtype, bias=False)
        self.wo = Linear(f, e, ("mlp", "embed"), rngs=rngs, dtype=dtype, bias=False)
        self.relative_attention_bias = (
            param(rngs, (cfg.relative_attention_num_buckets, cfg.num_heads), ("buckets", "heads"), dtype)
            if cfg.per_layer_position_bias
            else None
        )
        self.eps = cfg.layer_norm_epsilon
        self.head_dim = cfg.d_kv
        self.act = cfg.dense_act_fn

    def __call__(self, x: jax.Array, bias: jax.Array, mask_bias: jax.Array, buckets: np.ndarray) -> jax.Array:
        """x [B, L, E] fp32; bias [1, H, L, L] (shared T5 bias, unused for umT5); mask_bias [B, 1, 1, L]."""
        dtype = self.q.kernel.dtype
        if self.relative_attention_bias is not None:
            bias = _position_bias(self.relative_attention_bias[...], buckets)
        h = rms_norm(x, self.attn_norm[...], self.eps).astype(dtype)
        q, k, v = (heads(p(h), self.head_dim) for p in (self.q, self.k, self.v))
        x = x + self.o(attention(q, k, v, bias + mask_bias, 1.0)).astype(jnp.float32)
        h = rms_norm(x, self.ffn_norm[...], self.eps).astype(dtype)
        gate = activation(self.act)(self.wi_0(h).astype(jnp.float32))
        return x + self.wo((gate * self.wi_1(h).astype(jnp.float32)).astype(dtype)).astype(jnp.float32)


class T5Encoder(nnx.Module):
    """T5 v1.1 / umT5 encoder stack: token ids [B, L] -> last hidden state [B, L, E] (fp32)."""

    def __init__(self, config: T5Config, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        cfg = config
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), dtype, scale=1.0)
        self.relative_attention_bias = (
            None
            if cfg.per_layer_position_bias
            else param(rngs, (cfg.relative_attention_num_buckets, cfg.num_heads), ("buckets", "heads"), dtype)
        )
        self.blocks = stack_blocks(lambda r: T5Block(cfg, dtype=dtype, rngs=r), cfg.num_layers, rngs)
        self.final_norm = param(rngs, (cfg.d_model,), ("embed",), dtype, init="ones")

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """input_ids [B, L] int; attention_mask [B, L] (1 = token, 0 = padding) or None (attend to all)."""
        cfg = self.config
        length = input_ids.shape[1]
        buckets = relative_position_buckets(
            length, cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
        )
        if self.relative_attention_bias is not None:
            bias = _position_bias(self.relative_attention_bias[...], buckets)
        else:
            bias = jnp.zeros((1, cfg.num_heads, length, length), jnp.float32)
        if attention_mask is None:
            mask_bias = jnp.zeros((input_ids.shape[0], 1, 1, length), jnp.float32)
        else:
            mask_bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, MASKED).astype(jnp.float32)
        x = self.embed[...][input_ids].astype(jnp.float32)
        x = scan_blocks(self.blocks, x, lambda block, c: block(c, bias, mask_bias, buckets))
        return rms_norm(x, self.final_norm[...], cfg.layer_norm_epsilon)


def abstract_model(config: T5Config, dtype: Any = jnp.float32) -> T5Encoder:
    """The encoder with ``jax.ShapeDtypeStruct`` parameters (shapes and logical axes, nothing allocated)."""
    return nnx.eval_shape(lambda: T5Encoder(config, dtype=dtype, rngs=nnx.Rngs(0)))
