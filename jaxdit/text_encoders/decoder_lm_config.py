"""The configuration of a decoder-LM text encoder: the text path of Qwen2 / Qwen2.5-VL, Qwen3 and Mistral.

These decoders share one design (a pre-norm stack of causal self-attention with grouped-query heads and a
SwiGLU MLP, RMSNorm, rotary position embeddings) and differ in a few switches, which is all this config
holds: biases on q/k/v (Qwen2), RMSNorm on each query and key head (Qwen3), an explicit head width
(Qwen3, Mistral), the RoPE base and scaling. :meth:`DecoderLMConfig.from_hf_config` reads them from a
transformers ``config.json`` as saved by transformers 4.x (``rope_theta`` / ``rope_scaling`` at top
level) or 5.x (``rope_parameters``, sub-configs under ``text_config``).

Qwen2.5-VL's multimodal RoPE ("mrope") gives every text token the same position on its three axes, so
for text it is the one-axis RoPE of Qwen2 (transformers' ``Qwen2_5_VLRotaryEmbedding`` splits the
frequencies into ``mrope_section`` groups, one per axis; with equal positions the groups recombine into
the plain frequency vector).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from jaxdit.text_encoders.common import read_json

__all__ = ["DecoderLMConfig", "rope_inverse_frequencies"]

#: transformers ``model_type`` of a text decoder -> (q/k/v bias, q/k norm, head width from the config).
#: Qwen2 and Qwen2.5-VL derive the head width from hidden_size / heads whatever the config says.
_TEXT_TYPES: dict[str, tuple[bool, bool, bool]] = {
    "qwen2": (True, False, False),
    "qwen2_vl": (True, False, False),
    "qwen2_vl_text": (True, False, False),
    "qwen2_5_vl": (True, False, False),
    "qwen2_5_vl_text": (True, False, False),
    "qwen3": (False, True, True),
    "mistral": (False, False, True),
}
#: Multimodal wrappers whose ``text_config`` holds the decoder (their vision tower is skipped on load).
_WRAPPERS = ("qwen2_vl", "qwen2_5_vl", "mistral3")
#: transformers' RoPE base when a config names none (Qwen2-VL / 2.5-VL: 1e6; the others 1e4).
_DEFAULT_THETA = {"qwen2_vl": 1e6, "qwen2_vl_text": 1e6, "qwen2_5_vl": 1e6, "qwen2_5_vl_text": 1e6}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class DecoderLMConfig:
    """Hyper-parameters of a decoder LM's text path (transformers' names where they exist)."""

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    #: "default", "linear" (positions divided by rope_factor) or "llama3" (long wavelengths scaled).
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    qkv_bias: bool = True  # Qwen2 / Qwen2.5-VL
    o_bias: bool = False  # Qwen3's attention_bias covers o_proj too
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    #: Tokens each query sees when the checkpoint has a sliding window (None: all earlier tokens).
    #: Encoding runs full causal attention, so longer inputs are refused rather than computed differently.
    sliding_window: int | None = None
    model_type: str = "qwen2_5_vl"
    #: Qwen2.5-VL's multimodal RoPE: how many of the head_dim / 2 frequencies follow each position axis
    #: (time, row, column, then repeating). Only read when 3-axis position ids are given (image tokens).
    mrope_section: tuple[int, ...] | None = None

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # Qwen/Qwen2.5-VL-7B-Instruct's text model: Qwen-Image's (and HunyuanVideo 1.5's) text encoder.
        "qwen2.5-vl-7b": {"mrope_section": (16, 24, 24)},
        # Qwen/Qwen3-4B: Z-Image's text encoder.
        "qwen3-4b": {
            "vocab_size": 151936,
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "qkv_bias": False,
            "qk_norm": True,
            "model_type": "qwen3",
        },
        # Mistral Small 3.1 (24B)'s text model: FLUX.2 dev's text encoder.
        "mistral-small-3.1": {
            "vocab_size": 131072,
            "hidden_size": 5120,
            "intermediate_size": 32768,
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e9,
            "qkv_bias": False,
            "model_type": "mistral",
        },
    }

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"DecoderLMConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads} query heads do not group evenly over "
                f"{self.num_key_value_heads} key/value heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE rotates pairs of dimensions)")
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported; known: {', '.join(_ROPE_TYPES)}"
            )
        if self.mrope_section is not None and sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(
                f"mrope_section {self.mrope_section} must add up to head_dim / 2 = {self.head_dim // 2}"
            )
        if self.rope_factor <= 0:
            raise ValueError(f"rope_factor must be > 0, got {self.rope_factor}")

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> DecoderLMConfig:
        """A full-size preset (``qwen2.5-vl-7b``, ``qwen3-4b``, ``mistral-small-3.1``), fields overridden."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown decoder-LM preset {name!r}; known: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> DecoderLMConfig:
        """From a transformers ``config.json`` (a path or the parsed dict): a text decoder's own config, or
        a multimodal one (Qwen2-VL, Qwen2.5-VL, Mistral3) whose text decoder is read."""
        c = dict(config) if isinstance(config, Mapping) else read_json(config)
        outer = c.get("model_type")
        if outer in _WRAPPERS and isinstance(c.get("text_config"), Mapping):
            # transformers 4.x kept the text fields at top level too; the text_config is the newer truth.
            text = {k: v for k, v in c.items() if k not in ("text_config", "vision_config")}
            text.update(c["text_config"])
            text.setdefault("model_type", outer)
            c = text
        model_type = c.get("model_type")
        if model_type not in _TEXT_TYPES:
            raise ValueError(
                f"config is for model_type {model_type!r}, not a supported decoder LM; known: "
                f"{', '.join(sorted(_TEXT_TYPES))} (and the multimodal {', '.join(_WRAPPERS)})"
            )
        qkv_bias, qk_norm, own_head_dim = _TEXT_TYPES[model_type]
        act = c.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r}: the decoder LM's MLP is SwiGLU (silu) only")
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        head_dim = c.get("head_dim") if own_head_dim else None
        attention_bias = bool(c.get("attention_bias", False)) if model_type == "qwen3" else False
        window = c.get("sliding_window")
        if model_type.startswith("qwen") and not c.get("use_sliding_window", False):
            window = None  # Qwen configs carry a window size that is off unless use_sliding_window
        return cls(
            vocab_size=int(c["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(c["intermediate_size"]),
            num_hidden_layers=int(c["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(head_dim) if head_dim else hidden // heads,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias,
            qk_norm=qk_norm,
            sliding_window=int(window) if window else None,
            model_type=model_type,
            **_rope_fields(c, model_type),
        )


def _rope_fields(c: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """RoPE base and scaling from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError("per-layer-type RoPE parameters are not supported by the decoder-LM encoder")
    theta = params.get("rope_theta", c.get("rope_theta", _DEFAULT_THETA.get(model_type, 1e4)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "mrope":  # Qwen2-VL / 2.5-VL: equal positions on every axis for text (module doc)
        rope_type = "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"RoPE scaling {rope_type!r} is not supported by the decoder-LM encoder; known: "
            f"{', '.join(_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", c.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by the decoder-LM encoder")
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if params.get("mrope_section"):
        out["mrope_section"] = tuple(int(v) for v in params["mrope_section"])
    if rope_type in ("linear", "llama3"):
        out["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = float(params["low_freq_factor"])
        out["rope_high_freq_factor"] = float(params["high_freq_factor"])
        out["rope_original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings", c.get("max_position_embeddings", 8192))
        )
    return out


def rope_inverse_frequencies(cfg: DecoderLMConfig) -> np.ndarray:
    """The [head_dim / 2] rotation frequencies (fp32), scaled as the config's RoPE type says.

    default: theta^(-2j/D) (Su et al., arXiv 2104.09864). linear: divided by ``rope_factor`` (position
    interpolation, arXiv 2306.15595). llama3: wavelengths longer than original_max / low_freq_factor
    divided by the factor, shorter than original_max / high_freq_factor kept, and a linear blend between.
    """
    d = cfg.head_dim
    exponents = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
    inv = (np.float32(1.0) / np.power(np.float32(cfg.rope_theta), exponents)).astype(np.float32)
    if cfg.rope_type == "linear":
        return (inv / np.float32(cfg.rope_factor)).astype(np.float32)
    if cfg.rope_type == "llama3":
        factor, old = cfg.rope_factor, cfg.rope_original_max_position_embeddings
        low_wavelen = old / cfg.rope_low_freq_factor
        high_wavelen = old / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        blend = (old / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        smoothed = (1 - blend) * scaled / factor + blend * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv
