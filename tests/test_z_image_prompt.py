"""Z-Image's prompt encoding against diffusers' ``ZImagePipeline.encode_prompt``: a tiny Qwen3 text
encoder and an offline word-level tokenizer with a Qwen3-style chat template, saved as a pipeline folder
(``z_image_tiny.pipeline``). Prompts of different lengths keep their own lengths."""

from __future__ import annotations

import numpy as np
import pytest
import tolerance as tol
import z_image_tiny as tiny

from jaxdit.loading.decoder_lm import load_decoder_lm
from jaxdit.text_encoders.decoder_lm import DecoderLMRunner
from jaxdit.text_encoders.z_image_prompt import ZImagePromptEncoder

PROMPTS = ["a photo of a cat on a mat", "red car", "a big blue house with a tree at sunset and a small dog"]


@pytest.fixture(scope="module")
def folder_and_pipe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zimage") / "Z-Image-tiny"
    return folder, tiny.pipeline(folder)


@pytest.fixture(scope="module")
def encoder(folder_and_pipe):
    from transformers import AutoTokenizer

    folder, _ = folder_and_pipe
    tok = AutoTokenizer.from_pretrained(folder / "tokenizer")
    return ZImagePromptEncoder(tok, DecoderLMRunner(load_decoder_lm(folder / "text_encoder")))


def test_matches_diffusers_encode_prompt(folder_and_pipe, encoder):
    import torch

    _, pipe = folder_and_pipe
    with torch.no_grad():
        want, negative = pipe.encode_prompt(list(PROMPTS), device="cpu", do_classifier_free_guidance=True)
    got = encoder(PROMPTS)
    assert [g.shape for g in got] == [tuple(w.shape) for w in want]
    assert len({g.shape[0] for g in got}) == 3  # three lengths, none padded
    for g, w in zip(got, want, strict=True):
        tol.check(g, w.numpy(), tol.TORCH_FORWARD, "Z-Image prompt features vs diffusers")
    empty = encoder([""] * 3)
    for g, w in zip(empty, negative, strict=True):
        tol.check(g, w.numpy(), tol.TORCH_FORWARD, "Z-Image empty negative prompt vs diffusers")


def test_template_is_the_tokenizers_chat_turn(encoder):
    assert encoder.template("red car") == "<|im_start|>user\nred car<|im_end|>\n<|im_start|>assistant\n"


def test_cut_at_max_sequence_length_as_diffusers(folder_and_pipe, encoder):
    import torch

    _, pipe = folder_and_pipe
    with torch.no_grad():
        want, _ = pipe.encode_prompt(
            [PROMPTS[2]], device="cpu", do_classifier_free_guidance=False, max_sequence_length=6
        )
    got = encoder([PROMPTS[2]], max_sequence_length=6)
    assert got[0].shape == tuple(want[0].shape) == (6, 32)
    np.testing.assert_allclose(
        got[0], want[0].numpy(), rtol=0, atol=6e-6 * float(np.abs(want[0].numpy()).max())
    )


def test_a_tokenizer_without_chat_template_is_refused(encoder):
    class Plain:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        ZImagePromptEncoder(Plain(), encoder.encoder)
