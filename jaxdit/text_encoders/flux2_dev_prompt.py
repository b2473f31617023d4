"""FLUX.2 [dev]'s prompt encoding, as diffusers' ``Flux2Pipeline._get_mistral_3_small_prompt_embeds`` does
it (``pipelines/flux2/pipeline_flux2.py``) through Mistral Small 3.1's processor.

Each prompt becomes a two-turn conversation: a system turn holding :data:`SYSTEM_MESSAGE`, then the
prompt (with any ``[IMG]`` marker removed) as the user's turn, both as lists of text parts. The folder's
processor chat template writes it, without a generation prompt; the text is tokenized padded to
``max_sequence_length`` (512) and cut there, with the tokenizer's own special tokens added only when the
template did not already start with the BOS token (the processor's rule). The Mistral3 text decoder runs
with the padding masked as keys, and the hidden states after layers 10, 20 and 30 are stacked per token
(3 x 5120 = 15360 features for Mistral Small 3.1). As for klein every token is kept, padding included.

The processor itself (transformers' ``PixtralProcessor``) is not built: its image half is never used for
the prompt, and the text half is the tokenizer plus the template and the rule above. The template is
found where the processor finds it (``processor_config.json``, the legacy ``chat_template.json``, then
``chat_template.jinja``) and else taken from the tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxdit.text_encoders.decoder_lm import DecoderLMRunner
from jaxdit.text_encoders.flux2_prompt import DEV_HIDDEN_STATES, Flux2KleinPromptEncoder

__all__ = ["SYSTEM_MESSAGE", "Flux2DevPromptEncoder", "processor_chat_template"]

#: The system turn of every FLUX.2 [dev] prompt: Black Forest Labs' ``SYSTEM_MESSAGE``
#: (``src/flux2/system_messages.py`` of github.com/black-forest-labs/flux2, which diffusers'
#: ``pipelines/flux2/system_messages.py`` carries). It is model input, so it is kept to the character
#: (the line break included); ``tests/test_flux2_dev_cli.py`` compares it with diffusers'.
SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on "
    "object relationships, object\nattribution and actions without speculation."
)
#: Image placeholders are removed from prompts (the processor would count them against pictures).
IMAGE_MARKER = "[IMG]"


def processor_chat_template(folder: str | Path, tokenizer: Any = None) -> str | None:
    """The chat template a processor saved in ``folder`` uses, in transformers' order of precedence: the
    processor config's ``chat_template``, a legacy ``chat_template.json``, ``chat_template.jinja``; else
    the tokenizer's own (None when there is none)."""
    folder = Path(folder)
    config = folder / "processor_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        if template:
            return template
    legacy = folder / "chat_template.json"
    if legacy.is_file():
        return json.loads(legacy.read_text())["chat_template"]
    raw = folder / "chat_template.jinja"
    if raw.is_file():
        return raw.read_text(encoding="utf-8")
    return getattr(tokenizer, "chat_template", None) or None


class Flux2DevPromptEncoder(Flux2KleinPromptEncoder):
    """Tokenizer + processor chat template + the Mistral3 text decoder -> [B, L, 3 E] fp32 (klein's call;
    its own checks, template and tokenization)."""

    def __init__(
        self,
        tokenizer: Any,
        encoder: DecoderLMRunner,
        chat_template: str | None,
        layers: Sequence[int] = DEV_HIDDEN_STATES,
        system_message: str = SYSTEM_MESSAGE,
    ) -> None:
        if not chat_template:
            raise ValueError(
                "the tokenizer folder has no chat template: FLUX.2 [dev]'s prompts are Mistral chat turns "
                "(chat_template.jinja of the folder's tokenizer/)"
            )
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token: FLUX.2 [dev] pads every prompt to its length")
        encoder.model.layer_indices(tuple(layers))  # an encoder too shallow for the layers fails here
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.chat_template = chat_template
        self.layers = tuple(int(i) for i in layers)
        self.system_message = system_message

    def messages(self, prompt: str) -> list[dict[str, Any]]:
        """The conversation of one prompt: the system turn, then the user's."""
        return [
            {"role": "system", "content": [{"type": "text", "text": self.system_message}]},
            {"role": "user", "content": [{"type": "text", "text": prompt.replace(IMAGE_MARKER, "")}]},
        ]

    def template(self, prompt: str) -> str:
        """The prompt as the processor's chat template writes it (what diffusers tokenizes)."""
        return self.tokenizer.apply_chat_template(
            self.messages(prompt),
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=False,
        )

    def tokenize(self, prompts: Sequence[str], max_sequence_length: int) -> tuple[np.ndarray, np.ndarray]:
        """Templated prompts -> (input ids, attention mask) [B, max_sequence_length], padded and cut."""
        texts = [self.template(p) for p in prompts]
        bos = self.tokenizer.bos_token
        # The processor's rule, decided on the first text of the batch as it does: a template that writes
        # the BOS token itself is tokenized without the tokenizer adding its own.
        add_special = not (bos is not None and texts[0].startswith(bos))
        out = self.tokenizer(
            texts,
            max_length=max_sequence_length,
            padding="max_length",
            truncation=True,
            add_special_tokens=add_special,
            return_tensors="np",
        )
        return np.asarray(out.input_ids), np.asarray(out.attention_mask)
