"""HunyuanVideo 1.5's prompt encoding, as diffusers' ``HunyuanVideo15Pipeline`` does it
(``_get_mllm_prompt_embeds``, ``_get_byt5_prompt_embeds`` and ``extract_glyph_texts`` of
``pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py``).

Two encoders:

- the prompt (an empty one as a single space) as the user's turn after a fixed system message, through
  the tokenizer's chat template with the generation prompt, padded and cut to 1000 + 108 tokens; the
  Qwen2.5-VL text decoder's hidden state two layers before the last (transformers' ``hidden_states[-3]``)
  with the first 108 tokens dropped (a fixed count, the template's prefix for Qwen's tokenizer), and their
  mask: [B, 1000, C];
- the quoted text of the prompt (``"..."`` or curly quotes, repeats dropped when there are several),
  written as ``Text "a". Text "b". `` and run through ByT5 (a T5 encoder over bytes), padded and cut to 256
  tokens; a prompt without quoted text gives zeros under a zero mask: [B, 256, C2].

Both run on one device (``DecoderLMRunner``, the T5 encoder jitted there).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdit.text_encoders.decoder_lm import DecoderLMRunner

__all__ = [
    "GLYPH_TOKENS",
    "PROMPT_TOKENS",
    "SYSTEM_MESSAGE",
    "TEMPLATE_PREFIX_TOKENS",
    "HunyuanVideo15PromptEncoder",
    "glyph_text",
]

#: The system turn diffusers puts before every prompt (its text exactly, spaces included).
SYSTEM_MESSAGE = (
    "You are a helpful assistant. Describe the video by detailing the following aspects:         1. The main "
    "content and theme of the video.         2. The color, shape, size, texture, quantity, text, and spatial "
    "relationships of the objects.         3. Actions, events, behaviors temporal relationships, physical "
    "movement changes of the objects.         4. background environment, light, style and atmosphere.         "
    "5. camera angles, movements, and transitions used in the video."
)
#: Tokens dropped from the front of the templated prompt (``prompt_template_encode_start_idx``).
TEMPLATE_PREFIX_TOKENS = 108
#: Prompt tokens kept after them (``tokenizer_max_length``) and ByT5 tokens (``tokenizer_2_max_length``).
PROMPT_TOKENS, GLYPH_TOKENS = 1000, 256
#: Hidden layers skipped from the top: the output of layer L - 2 (``hidden_states[-3]``).
SKIPPED_LAYERS = 2
_QUOTED = re.compile(r"\"(.*?)\"|\u201c(.*?)\u201d")


def glyph_text(prompt: str) -> str | None:
    """The quoted text of ``prompt`` as ByT5 reads it, or None when it quotes nothing."""
    found = [a or b for a, b in _QUOTED.findall(prompt)]
    if len(found) > 1:
        found = list(dict.fromkeys(found))
    return ". ".join(f'Text "{t}"' for t in found) + ". " if found else None


class HunyuanVideo15PromptEncoder:
    """(Qwen tokenizer, Qwen2.5-VL decoder runner, ByT5 tokenizer, T5 encoder) -> ``__call__(prompts) ->
    (prompt_embeds [B, 1000, C], mask [B, 1000], glyph_embeds [B, 256, C2], glyph_mask [B, 256])``."""

    def __init__(self, tokenizer: Any, encoder: DecoderLMRunner, tokenizer_2: Any, encoder_2: Any) -> None:
        self.tokenizer, self.encoder = tokenizer, encoder
        self.tokenizer_2 = tokenizer_2
        graphdef, self._state_2 = nnx.split(encoder_2)
        self._t5 = jax.jit(lambda s, ids, mask: nnx.merge(graphdef, s)(ids, mask))
        self.glyph_width = encoder_2.config.d_model

    def prompt_features(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        chats = [
            [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": p or " "}]
            for p in prompts
        ]
        tokens = self.tokenizer.apply_chat_template(
            chats,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            padding="max_length",
            max_length=PROMPT_TOKENS + TEMPLATE_PREFIX_TOKENS,
            truncation=True,
            return_tensors="np",
        )
        ids, mask = np.asarray(tokens["input_ids"]), np.asarray(tokens["attention_mask"])
        layer = self.encoder.model.config.num_hidden_layers - SKIPPED_LAYERS
        hidden = np.asarray(self.encoder(ids, mask, layers=layer), np.float32)
        return hidden[:, TEMPLATE_PREFIX_TOKENS:], mask[:, TEMPLATE_PREFIX_TOKENS:]

    def glyph_features(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        embeds = np.zeros((len(prompts), GLYPH_TOKENS, self.glyph_width), np.float32)
        masks = np.zeros((len(prompts), GLYPH_TOKENS), np.int64)
        for i, prompt in enumerate(prompts):
            text = glyph_text(prompt)
            if text is None:
                continue
            t = self.tokenizer_2(
                text,
                padding="max_length",
                max_length=GLYPH_TOKENS,
                truncation=True,
                add_special_tokens=True,
                return_tensors="np",
            )
            ids, mask = jnp.asarray(t["input_ids"], jnp.int32), jnp.asarray(t["attention_mask"], jnp.int32)
            embeds[i] = np.asarray(self._t5(self._state_2, ids, mask), np.float32)[0]
            masks[i] = np.asarray(t["attention_mask"])[0]
        return embeds, masks

    def __call__(
        self, prompts: str | Sequence[str], max_sequence_length: int | None = None
    ) -> tuple[np.ndarray, ...]:
        if max_sequence_length not in (None, PROMPT_TOKENS):
            raise ValueError(
                f"HunyuanVideo 1.5 keeps {PROMPT_TOKENS} prompt tokens; max_sequence_length cannot change it"
            )
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a string or a non-empty list of strings")
        return (*self.prompt_features(prompts), *self.glyph_features(prompts))
