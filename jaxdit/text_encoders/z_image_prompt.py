"""Z-Image's prompt encoding, as diffusers' ``ZImagePipeline._encode_prompt`` does it
(``pipelines/z_image/pipeline_z_image.py``).

Each prompt becomes one user turn of the tokenizer's own chat template (Qwen3's, with the generation
prompt and ``enable_thinking=True``, which leaves the assistant turn open without a think block), is
tokenized and cut at ``max_sequence_length`` (512 by default), and passes the decoder-LM encoder (Qwen3-4B);
the features are the second-to-last hidden state (``hidden_states[-2]``: the output of the last layer but
one, before the final norm). Each prompt keeps its own length: one [L_i, E] array per prompt, which the
transformer pads to a multiple of 32 with its learnt pad token (``models/z_image_tokens.py``).

diffusers pads every prompt to ``max_sequence_length`` before encoding; the encoder is causal, so tokens
appended after a prompt change nothing in it, and this encoder pads the batch to its longest prompt only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxdit.text_encoders.decoder_lm import DecoderLMRunner

__all__ = ["HIDDEN_STATE", "MAX_SEQUENCE_LENGTH", "ZImagePromptEncoder"]

logger = logging.getLogger(__name__)

#: The hidden state taken (transformers' ``hidden_states`` index): the last layer but one.
HIDDEN_STATE = -2
#: diffusers' default cut of a templated prompt, in tokens.
MAX_SEQUENCE_LENGTH = 512


def _prompts(prompts: str | Sequence[str]) -> list[str]:
    out = [prompts] if isinstance(prompts, str) else list(prompts)
    if not out or not all(isinstance(p, str) for p in out):
        raise TypeError("prompts must be a string or a non-empty list of strings")
    return out


class ZImagePromptEncoder:
    """Tokenizer (Qwen3's, with its chat template) + the decoder-LM encoder -> one [L_i, E] array per
    prompt."""

    def __init__(self, tokenizer: Any, encoder: DecoderLMRunner) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template: Z-Image's prompts are Qwen3 chat turns "
                "(tokenizer_config.json / chat_template.jinja of the folder's tokenizer/)"
            )
        self.tokenizer = tokenizer
        self.encoder = encoder

    def template(self, prompt: str) -> str:
        """The prompt as the chat template writes it (what diffusers tokenizes)."""
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=True,
        )

    def tokenize(self, prompts: Sequence[str], max_sequence_length: int) -> tuple[np.ndarray, np.ndarray]:
        """Templated prompts -> (input ids, attention mask) [B, L], padded to the longest, cut at the limit."""
        texts = [self.template(p) for p in prompts]
        for i, ids in enumerate(self.tokenizer(texts, padding=False, truncation=False).input_ids):
            if len(ids) > max_sequence_length:
                logger.warning(
                    "prompt %d has %d tokens in the chat template; cut to %d as diffusers cuts it",
                    i,
                    len(ids),
                    max_sequence_length,
                )
        out = self.tokenizer(
            texts, max_length=max_sequence_length, padding=True, truncation=True, return_tensors="np"
        )
        return np.asarray(out.input_ids), np.asarray(out.attention_mask)

    def __call__(
        self, prompts: str | Sequence[str], *, max_sequence_length: int = MAX_SEQUENCE_LENGTH
    ) -> list[np.ndarray]:
        """Prompt(s) -> one float32 [L_i, E] array per prompt, L_i its templated token count (cut)."""
        prompts = _prompts(prompts)
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        ids, mask = self.tokenize(prompts, max_sequence_length)
        hidden = np.asarray(self.encoder(ids, mask, layers=HIDDEN_STATE), np.float32)
        return [hidden[i][mask[i].astype(bool)] for i in range(len(prompts))]
