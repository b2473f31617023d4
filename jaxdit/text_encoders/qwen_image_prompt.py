"""Qwen-Image's prompt encoding, as diffusers' ``QwenImagePipeline`` does it (``_get_qwen_prompt_embeds``
and ``encode_prompt`` of ``pipelines/qwenimage/pipeline_qwenimage.py``).

Each prompt is put in Qwen-Image's chat template (a system message asking for a detailed description,
then the prompt as the user's turn), the batch is tokenized to its longest prompt, and the decoder-LM
encoder's last hidden state is taken. Of each prompt's real tokens the template's first 34 (its system
prefix) are dropped; the rest keep their own lengths, right-padded with zeros to the longest, and a mask
marks the real ones: the transformer's text key mask.

Limits as diffusers sets them: the tokenizer cuts each templated prompt at 1024 + 34 tokens, and the
embeddings are cut at ``max_sequence_length`` (1024 by default) after the drop. A cut prompt is logged
with its token count (diffusers cuts silently).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxdit.text_encoders.decoder_lm import DecoderLMRunner

__all__ = ["DROPPED_PREFIX_TOKENS", "MAX_PROMPT_TOKENS", "PROMPT_TEMPLATE", "QwenImagePromptEncoder"]

logger = logging.getLogger(__name__)

#: The chat template of ``QwenImagePipeline.prompt_template_encode``; ``{}`` is the prompt.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
#: Tokens of the template's system prefix (``prompt_template_encode_start_idx``), dropped after encoding.
DROPPED_PREFIX_TOKENS = 34
#: Prompt tokens the tokenizer keeps after the prefix (``tokenizer_max_length``).
MAX_PROMPT_TOKENS = 1024


def _prompts(prompts: str | Sequence[str]) -> list[str]:
    out = [prompts] if isinstance(prompts, str) else list(prompts)
    if not out or not all(isinstance(p, str) for p in out):
        raise TypeError("prompts must be a string or a non-empty list of strings")
    return out


class QwenImagePromptEncoder:
    """Tokenizer (Qwen2's) + the decoder-LM encoder -> (prompt embeddings [B, T, E], mask [B, T])."""

    def __init__(self, tokenizer: Any, encoder: DecoderLMRunner) -> None:
        self.tokenizer = tokenizer
        self.encoder = encoder

    def tokenize(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Templated prompts -> (input ids, attention mask) [B, L], padded to the longest, cut at the limit."""
        texts = [PROMPT_TEMPLATE.format(p) for p in prompts]
        limit = MAX_PROMPT_TOKENS + DROPPED_PREFIX_TOKENS
        full = self.tokenizer(texts, padding=False, truncation=False).input_ids
        for i, ids in enumerate(full):
            if len(ids) > limit:
                logger.warning(
                    "prompt %d has %d tokens in the template (%d of them its prefix); cut to %d as diffusers "
                    "cuts it",
                    i,
                    len(ids),
                    DROPPED_PREFIX_TOKENS,
                    limit,
                )
        out = self.tokenizer(texts, max_length=limit, padding=True, truncation=True, return_tensors="np")
        return np.asarray(out.input_ids), np.asarray(out.attention_mask)

    def __call__(
        self, prompts: str | Sequence[str], *, max_sequence_length: int = MAX_PROMPT_TOKENS
    ) -> tuple[np.ndarray, np.ndarray]:
        """Prompt(s) -> (embeddings [B, T, E] float32, mask [B, T] int64): T is the longest prompt's token
        count after the dropped prefix (at most ``max_sequence_length``), zeros and 0 beyond each one's."""
        prompts = _prompts(prompts)
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        ids, mask = self.tokenize(prompts)
        hidden = np.asarray(self.encoder(ids, mask), np.float32)
        kept = [hidden[i][mask[i].astype(bool)][DROPPED_PREFIX_TOKENS:] for i in range(len(prompts))]
        longest = max(len(k) for k in kept)
        if longest == 0:
            raise ValueError(
                f"every prompt is within the template's {DROPPED_PREFIX_TOKENS}-token prefix: this tokenizer is "
                "not Qwen-Image's (its template prefix should be exactly that long)"
            )
        embeds = np.zeros((len(prompts), longest, hidden.shape[-1]), np.float32)
        out_mask = np.zeros((len(prompts), longest), np.int64)
        for i, k in enumerate(kept):
            embeds[i, : len(k)] = k
            out_mask[i, : len(k)] = 1
        return embeds[:, :max_sequence_length], out_mask[:, :max_sequence_length]
