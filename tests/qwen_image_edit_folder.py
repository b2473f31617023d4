"""Tiny random diffusers ``QwenImageEditPlusPipeline`` (Edit-2509) and ``QwenImageEditPipeline`` folders
(the same components: the tiny transformer of ``qwen_image_tiny.py``, the VAE of ``qwen_image_folder.py``, a
tiny Qwen2.5-VL with its vision tower, the word-level tokenizer with Qwen2.5-VL's vision markers, Qwen2-VL's
PIL image processor) and two pictures of different aspect ratios, shared by the Qwen-Image-Edit tests
(``test_qwen_image_edit.py`` says what the tiny setup changes and why).
"""

from __future__ import annotations

import json
from pathlib import Path

import decoder_lm_tiny as tiny
import numpy as np
import qwen_image_folder
import qwen_image_tiny
import torch
from PIL import Image

from jaxdit.pipelines import qwen_image_edit

#: The VAE pictures' area both sides use: the tiny VAE's factor 2 would make 1024^2 pictures 65536 tokens.
VAE_AREA = 64 * 64
MARKERS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION = dict(
    depth=2,
    hidden_size=16,
    intermediate_size=24,
    num_heads=2,
    out_hidden_size=32,
    patch_size=2,
    window_size=8,
    fullatt_block_indexes=[1],
)
PROCESSOR = dict(patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=16, max_pixels=20 * 28)
PICTURE_SHAPES = [(24, 24, 3), (20, 36, 3)]


class StandInProcessor:
    """``Qwen2VLProcessor(text=, images=, padding=True, return_tensors="pt")`` without its video half."""

    def __init__(self, tokenizer, image_processor, image_token_id):
        self.tokenizer, self.image_processor, self.image_token_id = tokenizer, image_processor, image_token_id

    def __call__(self, text, images=None, padding=True, return_tensors="pt"):
        from transformers import BatchFeature

        pixels = dict(self.image_processor(images=images, return_tensors="pt"))
        counts = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist())
        pad = "<|image_pad|>"
        expanded = []
        for t in text:
            parts = t.split(pad)
            expanded.append(
                "".join(p + (pad * next(counts) if k < len(parts) - 1 else "") for k, p in enumerate(parts))
            )
        tokens = dict(self.tokenizer(expanded, padding=padding, return_tensors="pt"))
        tokens["mm_token_type_ids"] = (tokens["input_ids"] == self.image_token_id).int()
        return BatchFeature({**tokens, **pixels})


def with_token_types(text_encoder, image_token_id):
    """The text encoder given the multimodal token types diffusers drops (its PR 14189)."""
    forward = text_encoder.forward

    def patched(*args, input_ids=None, **kwargs):
        kwargs.setdefault("mm_token_type_ids", (input_ids == image_token_id).int())
        return forward(*args, input_ids=input_ids, **kwargs)

    text_encoder.forward = patched
    return text_encoder


def patch_areas(patch) -> None:
    """Both sides' VAE picture area set to :data:`VAE_AREA` (``patch``: a ``pytest.MonkeyPatch``)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit_upstream
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as upstream

    patch.setattr(upstream, "VAE_IMAGE_SIZE", VAE_AREA)
    patch.setattr(qwen_image_edit, "VAE_AREA", VAE_AREA)
    edit_dimensions = edit_upstream.calculate_dimensions  # its 1024^2 is literal there: the same 64^2
    patch.setattr(edit_upstream, "calculate_dimensions", lambda area, ratio: edit_dimensions(VAE_AREA, ratio))


def _add_processor(folder: Path, images, tok) -> None:
    images.save_pretrained(folder / "processor")
    tok.save_pretrained(folder / "processor")
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index))


def save(root: Path, **transformer: object) -> dict:
    """Both folders and the pictures under ``root``: ``folders`` {"plus", "edit"}, ``paths`` (two PNGs),
    and ``reloaded(cls, folder)`` -> diffusers' pipeline from a folder with the stand-in processor.
    ``transformer``: overrides of the tiny transformer's config."""
    import diffusers
    from tokenizers import AddedToken
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    tok = AutoTokenizer.from_pretrained(tiny.save_qwen_tokenizer(root / "parts" / "tokenizer"))
    tok.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in MARKERS]}
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in MARKERS}
    text = dict(
        tiny.TEXT,
        num_hidden_layers=2,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e6},
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=VISION,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    encoder = tiny._perturb(Qwen2_5_VLForConditionalGeneration(config), 5)
    pipe = diffusers.QwenImageEditPlusPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**qwen_image_folder.SCHEDULER),
        vae=qwen_image_folder.vae(),
        text_encoder=encoder,
        tokenizer=tok,
        processor=None,
        transformer=qwen_image_tiny.transformer(joint_attention_dim=tiny.TEXT["hidden_size"], **transformer),
    )
    # Edit-2511 is a Plus folder whose transformer sets zero_cond_t
    folder = root / (
        "Qwen-Image-Edit-2511-tiny" if transformer.get("zero_cond_t") else "Qwen-Image-Edit-2509-tiny"
    )
    pipe.save_pretrained(folder)
    images = Qwen2VLImageProcessorPil(**PROCESSOR)
    _add_processor(folder, images, tok)
    edit_folder = root / "Qwen-Image-Edit-tiny"  # the original Edit: the same components, one picture
    diffusers.QwenImageEditPipeline(**pipe.components).save_pretrained(edit_folder)
    _add_processor(edit_folder, images, tok)
    rng = np.random.default_rng(1)
    paths = []
    for k, shape in enumerate(PICTURE_SHAPES):
        paths.append(root / f"picture{k}.png")
        Image.fromarray(rng.integers(0, 256, shape, np.uint8)).save(paths[-1])

    def reloaded(cls, where):
        ref = cls.from_pretrained(where, processor=None)
        object.__setattr__(ref, "processor", StandInProcessor(tok, images, config.image_token_id))
        with_token_types(ref.text_encoder, config.image_token_id)
        return ref

    return dict(folders={"plus": folder, "edit": edit_folder}, paths=paths, reloaded=reloaded)
