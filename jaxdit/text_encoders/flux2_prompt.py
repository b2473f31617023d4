"""FLUX.2 [klein]'s prompt encoding, as diffusers' ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` does it
(``pipelines/flux2/pipeline_flux2_klein.py``).

Each prompt becomes one user turn of the tokenizer's chat template (Qwen3's, generation prompt on,
``enable_thinking=False``: the assistant turn opens with an empty think block), is padded to
``max_sequence_length`` tokens (512 by default) and cut there, and passes the Qwen3 decoder with the
padding masked as keys. The features are the hidden states after layers 9, 18 and 27 (transformers'
``hidden_states`` indices), stacked per token: [B, L, 3 E], feature j*E + e from layer index j.

Unlike Z-Image, every one of the L tokens is kept, padding included: the transformer attends to all
of them (diffusers passes no text mask), so the padded positions' features must be what the decoder
makes of them (each attends causally to the real tokens before it; its own key is masked).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxdit.text_encoders.decoder_lm import DecoderLMRunner

__all__ = [
    "DEV_HIDDEN_STATES",
    "HIDDEN_STATES",
    "MAX_SEQUENCE_LENGTH",
    "Flux2KleinPromptEncoder",
    "stacked_features",
]

#: The hidden states stacked (transformers' ``hidden_states`` indices): diffusers' default
#: ``text_encoder_out_layers``, the same for the 4B and the 9B model.
HIDDEN_STATES = (9, 18, 27)
#: FLUX.2 [dev]'s: layers 10, 20 and 30 of Mistral Small 3.1's text decoder (diffusers'
#: ``Flux2Pipeline._get_mistral_3_small_prompt_embeds``), stacked the same way.
DEV_HIDDEN_STATES = (10, 20, 30)
#: diffusers' default (and the pad length of every prompt), in tokens.
MAX_SEQUENCE_LENGTH = 512


def stacked_features(
    encoder: DecoderLMRunner, ids: np.ndarray, mask: np.ndarray, layers: Sequence[int]
) -> np.ndarray:
    """Token ids and mask [B, L] -> the hidden states ``layers`` stacked per token, float32
    [B, L, len(layers) * E] (feature j * E + e from ``layers[j]``), as both FLUX.2 pipelines build them."""
    hidden = np.asarray(encoder(ids, mask, layers=tuple(int(i) for i in layers)), np.float32)
    b, n, length, e = hidden.shape  # [B, n, L, E]
    return hidden.transpose(0, 2, 1, 3).reshape(b, length, n * e)


class Flux2KleinPromptEncoder:
    """Tokenizer (Qwen3's, with its chat template) + the Qwen3 encoder -> [B, L, 3 E] fp32."""

    def __init__(
        self, tokenizer: Any, encoder: DecoderLMRunner, layers: Sequence[int] = HIDDEN_STATES
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template: FLUX.2 klein's prompts are Qwen3 chat turns "
                "(tokenizer_config.json / chat_template.jinja of the folder's tokenizer/)"
            )
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token: FLUX.2 klein pads every prompt to its length")
        encoder.model.layer_indices(tuple(layers))  # an encoder too shallow for the layers fails here
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.layers = tuple(int(i) for i in layers)

    def template(self, prompt: str) -> str:
        """The prompt as the chat template writes it (what diffusers tokenizes)."""
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )

    def tokenize(self, prompts: Sequence[str], max_sequence_length: int) -> tuple[np.ndarray, np.ndarray]:
        """Templated prompts -> (input ids, attention mask) [B, max_sequence_length], padded and cut."""
        out = self.tokenizer(
            [self.template(p) for p in prompts],
            max_length=max_sequence_length,
            padding="max_length",
            truncation=True,
            return_tensors="np",
        )
        return np.asarray(out.input_ids), np.asarray(out.attention_mask)

    def __call__(
        self, prompts: str | Sequence[str], *, max_sequence_length: int = MAX_SEQUENCE_LENGTH
    ) -> np.ndarray:
        """Prompt(s) -> float32 [B, max_sequence_length, len(layers) * E]."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a string or a non-empty list of strings")
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        ids, mask = self.tokenize(prompts, max_sequence_length)
        return stacked_features(self.encoder, ids, mask, self.layers)
