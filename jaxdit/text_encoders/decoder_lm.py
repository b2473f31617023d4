"""A decoder language model used as a text encoder: the text path of Qwen2 / Qwen2.5-VL, Qwen3 and Mistral.

These are one architecture (a pre-norm decoder, Touvron et al., arXiv 2302.13971) with a few switches
taken from the checkpoint's transformers ``config.json``:

- RMSNorm (Zhang & Sennrich, arXiv 1910.07467) before attention and MLP, and after the last layer;
- rotary position embeddings (Su et al., arXiv 2104.09864) with the checkpoint's ``rope_theta``, on the
  "rotate half" layout transformers uses. Qwen2.5-VL's multimodal RoPE gives text tokens the same
  position on all three axes, so for text it is this 1-D RoPE;
- grouped-query attention (Ainslie et al., arXiv 2305.13245): ``num_key_value_heads`` K/V heads, each
  shared by ``num_attention_heads / num_key_value_heads`` query heads; causal, plus a key padding mask;
- Qwen2 biases on q/k/v; Qwen3 an RMSNorm over each head's q and k before RoPE;
- a SwiGLU MLP (Shazeer, arXiv 2002.05202): down(silu(gate(x)) * up(x)).

The parameters are a plain pytree of transformers' tensors (kernels kept [out, in]), layers stacked on a
leading axis and run with ``lax.scan``, so compile time does not depend on depth. Norms and the softmax
are computed in fp32; matmuls in the parameters' dtype with fp32 accumulation.

Shape letters: B batch, L tokens, H query heads, K key/value heads, D head_dim, E hidden_size.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxdit.models.layers import rms_norm
from jaxdit.text_encoders.common import MASKED, read_json

__all__ = ["DecoderLMConfig", "encode", "parameter_shapes"]

#: transformers ``model_type`` values whose text path this module computes.
MODEL_TYPES = ("qwen2", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl", "qwen3", "mistral", "llama")


@dataclasses.dataclass(frozen=True)
class DecoderLMConfig:
    """Hyper-parameters of the decoder (transformers' names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False  # Qwen2 / Qwen2.5-VL: biases on q, k, v (never on o)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    sliding_window: int | None = None  # only checked: prompts longer than it are refused

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecoderLMConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> DecoderLMConfig:
        """From a transformers ``config.json`` (a path or the parsed dict); Qwen2.5-VL's text part is
        read from ``text_config`` when present, else from the top level (older layouts)."""
        c = dict(config) if isinstance(config, Mapping) else read_json(config)
        model_type = c.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config is for model_type {model_type!r}, not one of {', '.join(MODEL_TYPES)}")
        if isinstance(c.get("text_config"), Mapping):
            c = {**c, **c["text_config"]}
        # transformers 5 writes ``rope_parameters`` (with the theta); older versions ``rope_scaling``.
        scaling = c.get("rope_scaling") or c.get("rope_parameters") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "mrope"):
            raise ValueError(f"rope_scaling type {kind!r} is not supported (only default RoPE)")
        heads = int(c["num_attention_heads"])
        head_dim = c.get("head_dim") or int(c["hidden_size"]) // heads
        window = c.get("sliding_window")
        if model_type.startswith("qwen2") and not c.get("use_sliding_window", False):
            window = None
        theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return cls(
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]),
            num_hidden_layers=int(c["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rope_theta=float(theta),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(c.get("attention_bias", model_type.startswith("qwen2"))),
            qk_norm=model_type == "qwen3",
            sliding_window=int(window) if window else None,
        )


def parameter_shapes(cfg: DecoderLMConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape, named as transformers names it inside one layer (``layers.`` entries
    carry the stacked layer axis first)."""
    n, e, f, d = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hd, kd = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {
        "embed_tokens.weight": (cfg.vocab_size, e),
        "norm.weight": (e,),
        "layers.input_layernorm.weight": (n, e),
        "layers.post_attention_layernorm.weight": (n, e),
        "layers.self_attn.q_proj.weight": (n, hd, e),
        "layers.self_attn.k_proj.weight": (n, kd, e),
        "layers.self_attn.v_proj.weight": (n, kd, e),
        "layers.self_attn.o_proj.weight": (n, e, hd),
        "layers.mlp.gate_proj.weight": (n, f, e),
        "layers.mlp.up_proj.weight": (n, f, e),
        "layers.mlp.down_proj.weight": (n, e, f),
    }
    if cfg.attention_bias:
        shapes |= {f"layers.self_attn.{p}_proj.bias": (n, s) for p, s in (("q", hd), ("k", kd), ("v", kd))}
    if cfg.qk_norm:
        shapes |= {f"layers.self_attn.{p}_norm.weight": (n, d) for p in ("q", "k")}
    return shapes


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    y = jnp.einsum("...i,oi->...o", x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    return y if b is None else y + b.astype(jnp.float32)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate [B, L, H, D] by the angles ([L, D/2]) on the rotate-half layout, in fp32."""
    x = x.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    c, s = cos[None, :, None], sin[None, :, None]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _layer(cfg: DecoderLMConfig, p: Mapping[str, jax.Array], x: jax.Array, bias: jax.Array, cos, sin):
    dtype = x.dtype
    b, l, _ = x.shape
    d, h, k = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    a = "self_attn."
    hn = rms_norm(x, p["input_layernorm.weight"], cfg.rms_norm_eps).astype(dtype)
    q = _linear(hn, p[a + "q_proj.weight"], p.get(a + "q_proj.bias")).reshape(b, l, h, d)
    kk = _linear(hn, p[a + "k_proj.weight"], p.get(a + "k_proj.bias")).reshape(b, l, k, d)
    v = _linear(hn, p[a + "v_proj.weight"], p.get(a + "v_proj.bias")).reshape(b, l, k, d).astype(dtype)
    if cfg.qk_norm:
        q = rms_norm(q, p[a + "q_norm.weight"], cfg.rms_norm_eps)
        kk = rms_norm(kk, p[a + "k_norm.weight"], cfg.rms_norm_eps)
    q, kk = _rope(q, cos, sin).astype(dtype), _rope(kk, cos, sin).astype(dtype)
    # Grouped-query attention without repeating K/V: query heads grouped as [K, H/K].
    q = q.reshape(b, l, k, h // k, d)
    s = jnp.einsum("blkgd,bmkd->bkglm", q, kk, preferred_element_type=jnp.float32) * d**-0.5
    probs = jax.nn.softmax(s + bias[:, None, None], axis=-1)
    o = jnp.einsum("bkglm,bmkd->blkgd", probs.astype(dtype), v, preferred_element_type=jnp.float32)
    x = x + _linear(o.reshape(b, l, h * d).astype(dtype), p[a + "o_proj.weight"]).astype(dtype)
    hn = rms_norm(x, p["post_attention_layernorm.weight"], cfg.rms_norm_eps).astype(dtype)
    m = jax.nn.silu(_linear(hn, p["mlp.gate_proj.weight"])) * _linear(hn, p["mlp.up_proj.weight"])
    return x + _linear(m.astype(dtype), p["mlp.down_proj.weight"]).astype(dtype)


def encode(
    cfg: DecoderLMConfig,
    params: Mapping[str, jax.Array],
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    layers: Sequence[int] | None = None,
) -> jax.Array:
    """Hidden states of ``input_ids`` [B, L] (``attention_mask`` [B, L], 1 = real token, padding on the
    right), computed in the parameters' dtype.

    ``layers=None``: the last layer after the final norm, [B, L, E]. Otherwise a list of indices into
    transformers' ``hidden_states`` tuple (0 = embeddings, i = output of layer i, ``num_hidden_layers`` or
    -1 = the normed last layer), stacked as [B, len(layers), L, E].
    """
    b, l = input_ids.shape
    if cfg.sliding_window is not None and l > cfg.sliding_window:
        raise ValueError(
            f"{l} tokens exceed the sliding window {cfg.sliding_window}, which is not implemented"
        )
    n = cfg.num_hidden_layers
    wanted = None
    if layers is not None:
        wanted = [i + n + 1 if i < 0 else i for i in layers]
        bad = [i for i, w in zip(layers, wanted, strict=True) if not 0 <= w <= n]
        if bad or not wanted:
            raise ValueError(f"layers {list(layers)}: indices must lie in [-{n + 1}, {n}] and be non-empty")
    mask = jnp.ones((b, l), bool) if attention_mask is None else jnp.asarray(attention_mask).astype(bool)
    causal = jnp.tril(jnp.ones((l, l), bool))
    bias = jnp.where(causal[None] & mask[:, None, :], 0.0, MASKED).astype(jnp.float32)  # [B, L, L]
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim))
    angles = jnp.arange(l, dtype=jnp.float32)[:, None] * inv_freq[None]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x = params["embed_tokens.weight"][input_ids]
    stacked = {k.removeprefix("layers."): v for k, v in params.items() if k.startswith("layers.")}

    def body(h, p):
        h = _layer(cfg, p, h, bias, cos, sin)
        return h, (h if wanted is not None else None)

    last, per_layer = jax.lax.scan(body, x, stacked)
    final = rms_norm(last, params["norm.weight"], cfg.rms_norm_eps).astype(x.dtype)
    if wanted is None:
        return final
    states = jnp.concatenate([x[None], per_layer[:-1], final[None]], axis=0)  # HF's hidden_states order
    return jnp.moveaxis(states[jnp.asarray(wanted)], 0, 1)
