"""Qwen-Image-Edit's prompt encoding with pictures, as diffusers' ``QwenImageEditPipeline`` and
``QwenImageEditPlusPipeline`` do it (``_get_qwen_prompt_embeds`` of ``pipelines/qwenimage/
pipeline_qwenimage_edit.py`` and ``pipeline_qwenimage_edit_plus.py``).

The instruction goes into the edit chat template (a system message asking to describe the input picture
and how the instruction changes it). Qwen-Image-Edit's template holds one picture slot before the
instruction; the Plus template (Edit-2509 / 2511) takes a ``Picture k: <slot>`` line per input picture.
The processor then does what ``Qwen2VLProcessor`` does: each picture is resized and cut into patches by
the folder's image processor, and its slot marker (``<|image_pad|>``) is repeated once per merged patch.
Qwen2.5-VL (:class:`~jaxdit.text_encoders.qwen_vl_encoder.QwenVLEncoder`: the vision tower's tokens
spliced in, 3-axis RoPE) encodes the result; of its last hidden state the template's first 64 tokens
(the system prefix) are dropped, and each prompt keeps its own length under a mask.

diffusers tokenizes without a length limit here (its ``max_sequence_length`` is not applied by the edit
pipelines' encoder), so nothing is cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxdit.text_encoders.qwen_vl_encoder import QwenVLEncoder

__all__ = [
    "DROPPED_PREFIX_TOKENS",
    "EDIT_PLUS_TEMPLATE",
    "EDIT_TEMPLATE",
    "IMAGE_PAD",
    "QwenImageEditPromptEncoder",
]

_SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a "
    "new image that meets the user's requirements while maintaining consistency with the original input "
    "where appropriate.<|im_end|>\n<|im_start|>user\n"
)
_TAIL = "{}<|im_end|>\n<|im_start|>assistant\n"
#: The vision slot marker the processor expands (one token per merged patch of the picture).
IMAGE_PAD = "<|image_pad|>"
_SLOT = "<|vision_start|>" + IMAGE_PAD + "<|vision_end|>"
#: ``QwenImageEditPipeline.prompt_template_encode``: one picture before the instruction.
EDIT_TEMPLATE = _SYSTEM + _SLOT + _TAIL
#: ``QwenImageEditPlusPipeline.prompt_template_encode``; the instruction is prefixed with one
#: :data:`PICTURE_LINE` per picture.
EDIT_PLUS_TEMPLATE = _SYSTEM + _TAIL
PICTURE_LINE = "Picture {}: " + _SLOT
#: Tokens of the template's system prefix (``prompt_template_encode_start_idx``), dropped after encoding.
DROPPED_PREFIX_TOKENS = 64


class QwenImageEditPromptEncoder:
    """Tokenizer + image processor + Qwen2.5-VL with its vision tower -> (embeddings [B, T, E], mask [B, T]).

    ``plus``: the Plus template (any number of pictures, each on its own ``Picture k:`` line); otherwise
    Qwen-Image-Edit's (exactly one picture). ``image_processor``: transformers' ``Qwen2VLImageProcessor``
    (the folder's ``processor/``), called with ``return_tensors="np"``.
    """

    def __init__(self, tokenizer: Any, image_processor: Any, encoder: QwenVLEncoder, *, plus: bool) -> None:
        self.tokenizer, self.image_processor, self.encoder, self.plus = (
            tokenizer,
            image_processor,
            encoder,
            plus,
        )
        self.merge = int(getattr(image_processor, "merge_size", encoder.vision.spatial_merge_size))
        if self.merge != encoder.vision.spatial_merge_size:
            raise ValueError(
                f"the image processor merges {self.merge}x{self.merge} patches, the vision tower "
                f"{encoder.vision.spatial_merge_size}x{encoder.vision.spatial_merge_size}"
            )

    def texts(self, prompts: Sequence[str], pictures: int) -> list[str]:
        """The templated prompts, before the slots are expanded."""
        if self.plus:
            lines = "".join(PICTURE_LINE.format(k + 1) for k in range(pictures))
            return [EDIT_PLUS_TEMPLATE.format(lines + p) for p in prompts]
        if pictures != 1:
            raise ValueError(f"Qwen-Image-Edit reads exactly one input picture, got {pictures}")
        return [EDIT_TEMPLATE.format(p) for p in prompts]

    def inputs(self, prompts: Sequence[str], images: Sequence[Any]) -> dict[str, np.ndarray]:
        """What ``Qwen2VLProcessor(text=, images=, padding=True)`` gives: input_ids, attention_mask,
        pixel_values, image_grid_thw. Every prompt reads all the pictures (as diffusers calls it with
        one prompt)."""
        texts = self.texts(prompts, len(images))
        pixels = self.image_processor(images=list(images) * len(prompts), return_tensors="np")
        grid = np.asarray(pixels["image_grid_thw"], np.int64)
        counts = iter((grid.prod(-1) // self.merge**2).tolist())
        expanded = []
        for text in texts:
            parts = text.split(IMAGE_PAD)
            expanded.append(
                "".join(
                    part + (IMAGE_PAD * next(counts) if k < len(parts) - 1 else "")
                    for k, part in enumerate(parts)
                )
            )
        tokens = self.tokenizer(expanded, padding=True, return_tensors="np")
        return dict(
            input_ids=np.asarray(tokens["input_ids"]),
            attention_mask=np.asarray(tokens["attention_mask"]),
            pixel_values=np.asarray(pixels["pixel_values"], np.float32),
            image_grid_thw=grid,
        )

    def __call__(
        self, prompts: str | Sequence[str], images: Sequence[Any], **_: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        """Prompt(s) and the condition pictures (PIL images at the condition size) -> (embeddings [B, T, E]
        float32, mask [B, T] int64), zeros and 0 past each prompt's real tokens."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a string or a non-empty list of strings")
        if not images:
            raise ValueError("Qwen-Image-Edit's prompt encoder needs at least one input picture")
        x = self.inputs(prompts, images)
        hidden = np.asarray(
            self.encoder(x["input_ids"], x["attention_mask"], x["pixel_values"], x["image_grid_thw"]),
            np.float32,
        )
        mask = x["attention_mask"].astype(bool)
        kept = [hidden[i][mask[i]][DROPPED_PREFIX_TOKENS:] for i in range(len(prompts))]
        longest = max(len(k) for k in kept)
        if longest == 0:
            raise ValueError(
                f"every prompt is within the template's {DROPPED_PREFIX_TOKENS}-token prefix: this tokenizer "
                "is not Qwen-Image-Edit's"
            )
        embeds = np.zeros((len(prompts), longest, hidden.shape[-1]), np.float32)
        out_mask = np.zeros((len(prompts), longest), np.int64)
        for i, k in enumerate(kept):
            embeds[i, : len(k)] = k
            out_mask[i, : len(k)] = 1
        return embeds, out_mask
