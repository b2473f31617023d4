"""Prompt and image encoders for the FLUX and Wan pipelines: tokenizer + jitted encoder on one device.

"A text encoder on a card of its own": the encoders run once per prompt, before the denoising loop, so
they are not sharded over the transformer's mesh. Each encoder places all its weights on ONE device of
the caller's choosing (``device=``, a ``jax.Device``; default ``jax.local_devices()[0]``) and runs there,
jitted. It never needs the mesh: put it on a device the transformer does not use (or share one, if memory
allows) and hand the embeddings to the pipeline, which shards them like any other input.

What each returns mirrors diffusers, call for call:

- :class:`FluxTextEncoders` = ``FluxPipeline.encode_prompt``: T5 (``tokenizer_2``/``text_encoder_2``)
  padded to ``max_sequence_length`` with no attention mask, and CLIP's ``pooler_output`` over 77 tokens
  padded to the tokenizer's ``model_max_length``.
- :class:`WanTextEncoder` = ``WanPipeline._get_t5_prompt_embeds``: prompts cleaned (ftfy when installed,
  HTML unescaped, whitespace collapsed), umT5 run WITH the attention mask, each prompt's embeddings kept
  to its token count and zero beyond it, up to ``max_sequence_length``. Reads a diffusers WanPipeline
  folder (``text_encoder/``, ``tokenizer/``) or Wan's original folder
  (``models_t5_umt5-xxl-enc-bf16.pth``, ``google/umt5-xxl/``).
- :class:`WanImageEncoder` = ``WanImageToVideoPipeline.encode_image``: ``CLIPImageProcessor``
  preprocessing, then the CLIP vision model's penultimate hidden states (``hidden_states[-2]``),
  [B, 257, 1280] for ViT-H/14.

``__call__`` returns numpy float32 arrays on the host; ``encode`` returns the same as ``jax.Array`` on the
encoder's device. ``jaxdit.loading.encoders`` builds them from a model folder (weights through the
converters, tokenizers through transformers' ``AutoTokenizer``).
"""

from __future__ import annotations

import html
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdit.text_encoders import clip as clip_model
from jaxdit.text_encoders import t5 as t5_model
from jaxdit.text_encoders.common import jit_forward

__all__ = ["FluxTextEncoders", "WanImageEncoder", "WanTextEncoder", "prompt_clean"]

logger = logging.getLogger(__name__)

#: CLIP's context length, used when a tokenizer does not say.
CLIP_MAX_LENGTH = 77


def _prompts(prompts: str | Sequence[str]) -> list[str]:
    out = [prompts] if isinstance(prompts, str) else list(prompts)
    if not out or not all(isinstance(p, str) for p in out):
        raise TypeError("prompts must be a string or a non-empty list of strings")
    return out


def _warn_truncated(tokenizer: Any, prompts: list[str], ids: np.ndarray, what: str) -> None:
    """Log the part of each prompt a fixed length cut off (diffusers logs the same)."""
    full = tokenizer(prompts, padding="longest", return_tensors="np").input_ids
    if full.shape[-1] >= ids.shape[-1] and not np.array_equal(full[:, : ids.shape[-1]], ids):
        removed = tokenizer.batch_decode(full[:, ids.shape[-1] - 1 : -1])
        logger.warning(
            "%s: this part of the prompt was truncated at %d tokens: %s", what, ids.shape[-1], removed
        )


def _put(x: np.ndarray, device: jax.Device) -> jax.Array:
    return jax.device_put(np.asarray(x, np.int32), device)


# --------------------------------------------------------------------------------------------------------
# FLUX
# --------------------------------------------------------------------------------------------------------


class FluxTextEncoders:
    """FLUX.1's two text encoders: T5-XXL token embeddings and CLIP-L's pooled embedding."""

    def __init__(
        self,
        clip: clip_model.CLIPTextModel,
        t5: t5_model.T5Encoder,
        clip_tokenizer: Any,
        t5_tokenizer: Any,
        *,
        compiler_options: Mapping[str, Any] | None = None,
        offload: bool = False,
    ) -> None:
        self.clip, self.t5 = clip, t5
        self.clip_tokenizer, self.t5_tokenizer = clip_tokenizer, t5_tokenizer
        self.device = _device_of(t5)
        self.clip_device = _device_of(clip)
        self.clip_max_length = int(
            getattr(clip_tokenizer, "model_max_length", CLIP_MAX_LENGTH) or CLIP_MAX_LENGTH
        )
        self._clip = jit_forward(clip, lambda m, ids: m(ids)[1], compiler_options, offload=offload)
        self._t5 = jit_forward(t5, lambda m, ids: m(ids), compiler_options, offload=offload)

    def tokenize(
        self, prompts: str | Sequence[str], max_sequence_length: int = 512
    ) -> tuple[np.ndarray, np.ndarray]:
        """(CLIP ids [B, 77], T5 ids [B, max_sequence_length]), padded and truncated as diffusers does."""
        prompts = _prompts(prompts)
        clip_ids = self.clip_tokenizer(
            prompts,
            padding="max_length",
            max_length=self.clip_max_length,
            truncation=True,
            return_tensors="np",
        ).input_ids
        _warn_truncated(self.clip_tokenizer, prompts, clip_ids, "CLIP")
        t5_ids = self.t5_tokenizer(
            prompts,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            return_tensors="np",
        ).input_ids
        _warn_truncated(self.t5_tokenizer, prompts, t5_ids, "T5")
        return clip_ids, t5_ids

    def encode(
        self, prompts: str | Sequence[str], max_sequence_length: int = 512
    ) -> tuple[jax.Array, jax.Array]:
        """(prompt_embeds [B, L, 4096], pooled [B, 768]) as fp32 ``jax.Array`` on the encoders' device."""
        clip_ids, t5_ids = self.tokenize(prompts, max_sequence_length)
        return self._t5(_put(t5_ids, self.device)), self._clip(_put(clip_ids, self.clip_device))

    def __call__(
        self, prompts: str | Sequence[str], max_sequence_length: int = 512
    ) -> tuple[np.ndarray, np.ndarray]:
        """(prompt_embeds [B, L, 4096], pooled [B, 768]) as numpy float32, like ``FluxPipeline.encode_prompt``."""
        embeds, pooled = self.encode(prompts, max_sequence_length)
        return np.asarray(embeds, np.float32), np.asarray(pooled, np.float32)


# --------------------------------------------------------------------------------------------------------
# Wan
# --------------------------------------------------------------------------------------------------------


def prompt_clean(text: str) -> str:
    """diffusers' / Wan's prompt cleaning: ftfy (when installed), HTML unescaped twice, whitespace collapsed."""
    try:
        import ftfy
    except ImportError:
        pass
    else:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    try:
        import regex as re  # what diffusers and Wan use; `re` treats a few Unicode spaces differently
    except ImportError:
        import re
    return re.sub(r"\s+", " ", text).strip()


class WanTextEncoder:
    """Wan 2.1's umT5-XXL prompt encoder."""

    def __init__(
        self,
        t5: t5_model.T5Encoder,
        tokenizer: Any,
        *,
        compiler_options: Mapping[str, Any] | None = None,
        offload: bool = False,
    ) -> None:
        self.t5, self.tokenizer = t5, tokenizer
        self.device = _device_of(t5)
        self._encode = jit_forward(t5, _wan_forward, compiler_options, offload=offload)

    def tokenize(
        self, prompts: str | Sequence[str], max_sequence_length: int = 512
    ) -> tuple[np.ndarray, np.ndarray]:
        """(ids, attention mask), both [B, max_sequence_length], of the cleaned prompts."""
        cleaned = [prompt_clean(p) for p in _prompts(prompts)]
        out = self.tokenizer(
            cleaned,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="np",
        )
        return out.input_ids, out.attention_mask

    def encode(self, prompts: str | Sequence[str], max_sequence_length: int = 512) -> jax.Array:
        """[B, max_sequence_length, 4096] fp32 ``jax.Array`` on the encoder's device."""
        ids, mask = self.tokenize(prompts, max_sequence_length)
        return self._encode(_put(ids, self.device), _put(mask, self.device))

    def __call__(self, prompts: str | Sequence[str], max_sequence_length: int = 512) -> np.ndarray:
        """[B, max_sequence_length, 4096] numpy float32, like ``WanPipeline._get_t5_prompt_embeds``."""
        return np.asarray(self.encode(prompts, max_sequence_length), np.float32)


def _wan_forward(model: t5_model.T5Encoder, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """Encode with the mask, then keep each row's first ``sum(mask)`` tokens and zero the rest (diffusers
    cuts each prompt to its length and pads it back with zeros)."""
    out = model(ids, mask)
    lengths = jnp.sum(mask > 0, axis=1)
    keep = jnp.arange(ids.shape[1])[None, :] < lengths[:, None]
    return jnp.where(keep[..., None], out, 0.0)


class WanImageEncoder:
    """Wan 2.1 I2V's CLIP image encoder: penultimate hidden states of a CLIP vision model."""

    def __init__(
        self,
        vision: clip_model.CLIPVisionModel,
        processor: Any,
        *,
        compiler_options: Mapping[str, Any] | None = None,
        offload: bool = False,
    ) -> None:
        self.vision, self.processor = vision, processor
        self.device = _device_of(vision)
        self._encode = jit_forward(
            vision, lambda m, px: m(px, hidden_layer=-2), compiler_options, offload=offload
        )

    def preprocess(self, images: Any) -> np.ndarray:
        """PIL image(s) or HWC arrays -> pixel_values [B, 3, S, S] float32 (``CLIPImageProcessor``)."""
        return np.asarray(self.processor(images=images, return_tensors="np")["pixel_values"], np.float32)

    def encode(self, images: Any) -> jax.Array:
        """[B, 1 + patches, E] fp32 ``jax.Array`` on the encoder's device."""
        pixels = jax.device_put(self.preprocess(images), self.device)
        return self._encode(pixels)

    def __call__(self, images: Any) -> np.ndarray:
        """[B, 257, 1280] numpy float32 for ViT-H/14, like ``WanImageToVideoPipeline.encode_image``."""
        return np.asarray(self.encode(images), np.float32)


def _device_of(model: Any) -> jax.Device:
    """The one device a loaded encoder's parameters live on."""
    devices = {d for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)) for d in leaf.devices()}
    if len(devices) != 1:
        raise ValueError(
            f"an encoder's parameters must live on one device, found {sorted(map(str, devices))}"
        )
    return devices.pop()
