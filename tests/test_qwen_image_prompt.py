"""Qwen-Image's prompt encoding against diffusers' ``QwenImagePipeline.encode_prompt``: the chat
template, the 34 dropped prefix tokens, per-prompt lengths -> mask, the limits, and the folder checks.

A tiny random Qwen2.5-VL text encoder and a word-level tokenizer with Qwen's chat markers (its template
prefix is 34 tokens, as Qwen's own tokenizer gives it), from ``decoder_lm_tiny.py``; the pipeline's other
components are tiny random models it never runs here. fp32; bounds from tests/tolerance.py.
"""

from __future__ import annotations

import json
import logging

import decoder_lm_tiny as tiny
import numpy as np
import pytest
import qwen_image_tiny
import tolerance as tol
import torch

from converters.errors import CheckpointError
from jaxdit.loading.qwen_image_encoder import load_qwen_image_prompt_encoder
from jaxdit.text_encoders.qwen_image_prompt import DROPPED_PREFIX_TOKENS, PROMPT_TEMPLATE

PROMPTS = ["a red car at sunset", "a big dog", "a photo of a small house with a tree and the blue sky"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_image_pipeline")
    tiny.save(tiny.qwen2_5_vl(), root / "text_encoder")
    tiny.save_qwen_tokenizer(root / "tokenizer")
    return root


@pytest.fixture(scope="module")
def pipeline(folder):
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    vae = AutoencoderKLQwenImage(
        base_dim=4, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False]
    )
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(folder / "text_encoder").eval(),
        tokenizer=AutoTokenizer.from_pretrained(folder / "tokenizer"),
        transformer=qwen_image_tiny.transformer(),
    )


@pytest.fixture(scope="module")
def encoder(folder):
    return load_qwen_image_prompt_encoder(folder)


def _reference(pipeline, prompts, **kw):
    with torch.no_grad():
        embeds, mask = pipeline.encode_prompt(prompts, device=torch.device("cpu"), **kw)
    n = embeds.shape[1]
    mask = (
        np.ones((len(prompts), n), np.int64) if mask is None else mask.numpy()
    )  # diffusers: None = all real
    return embeds.numpy(), mask


def test_template_and_prefix_match_diffusers(pipeline, encoder):
    assert pipeline.prompt_template_encode == PROMPT_TEMPLATE
    assert pipeline.prompt_template_encode_start_idx == DROPPED_PREFIX_TOKENS
    assert len(encoder.tokenizer(PROMPT_TEMPLATE.format("")).input_ids) == DROPPED_PREFIX_TOKENS + 5


def test_prompts_of_different_lengths_match_diffusers(pipeline, encoder):
    want, want_mask = _reference(pipeline, PROMPTS)
    got, mask = encoder(PROMPTS)
    np.testing.assert_array_equal(mask, want_mask)
    assert mask.sum(1).tolist() == [10, 8, 18]  # the prompt's words + the template's 5 closing tokens
    tol.check(got, want, tol.TORCH_FORWARD, "Qwen-Image prompt embeddings vs diffusers")
    one, one_mask = encoder(PROMPTS[1])  # alone: its own length, the same values
    tol.check(one[0], got[1, :8], tol.SHARDED, "a prompt alone vs in a batch")
    assert one.shape[1] == 8 and one_mask.all()


def test_limits_cut_as_diffusers_cuts(pipeline, encoder, caplog):
    want, want_mask = _reference(pipeline, PROMPTS, max_sequence_length=9)
    got, mask = encoder(PROMPTS, max_sequence_length=9)
    assert got.shape[1] == 9
    np.testing.assert_array_equal(mask, want_mask)
    tol.check(got, want, tol.TORCH_FORWARD, "max_sequence_length=9 vs diffusers")
    long = " ".join(["cat"] * 1030)  # 1030 + 39 template tokens: beyond 1024 + 34
    with caplog.at_level(logging.WARNING):
        got, mask = encoder(["a dog", long])
    assert "prompt 1 has 1069 tokens" in caplog.text and "cut to 1058" in caplog.text
    want, want_mask = _reference(pipeline, ["a dog", long])
    assert got.shape == want.shape and got.shape[1] == 1024
    np.testing.assert_array_equal(mask, want_mask)
    tol.check(got, want, tol.TORCH_FORWARD, "a 1069-token prompt vs diffusers")


def test_folders_without_qwen_text_encoder_are_refused(folder, tmp_path):
    with pytest.raises(
        CheckpointError, match=r"no text encoder; expected Qwen2.5-VL in .*empty/text_encoder"
    ):
        load_qwen_image_prompt_encoder(tmp_path / "empty")
    other = tmp_path / "other"
    (other / "text_encoder").mkdir(parents=True)
    (other / "text_encoder" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(CheckpointError, match=r"a 't5' text encoder; Qwen-Image's is Qwen2.5-VL"):
        load_qwen_image_prompt_encoder(other)
