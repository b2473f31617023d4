"""The Qwen2.5-VL encoder with pictures (vision tower, image tokens spliced in, 3-axis RoPE positions)
against transformers' ``Qwen2_5_VLForConditionalGeneration`` on the same processor output.

A tiny random model (two vision blocks, one windowed and one full, windows smaller than the images so
several windows and edge-cut windows occur) saved with ``save_pretrained``; the processor is built offline
(a word-level tokenizer with Qwen's vision markers and ``Qwen2VLImageProcessorPil``; each image-pad marker
is expanded to the image's token count as ``Qwen2_5_VLProcessor`` does, since that class needs torchvision
for its video half). Two prompts of
different lengths, one image each, different sizes, right-padded. fp32; errors printed (``pytest -s``).
"""

from __future__ import annotations

import decoder_lm_tiny as tiny
import numpy as np
import pytest
import torch

from jaxdit.loading.qwen_vl_encoder import load_qwen_vl_encoder
from jaxdit.text_encoders.qwen_vl_encoder import mrope_positions
from jaxdit.text_encoders.qwen_vl_vision import QwenVisionConfig, run_vision, vision_params

VISION_MARKERS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION = dict(
    depth=2,
    hidden_size=16,
    intermediate_size=24,
    num_heads=2,
    out_hidden_size=32,
    patch_size=2,
    window_size=8,  # 2 x 2 merged tokens a window
    fullatt_block_indexes=[1],
)
#: Relative bound (max abs error / max abs value) for an fp32 forward against torch's.
BOUND = 1e-5


def _relative(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tokenizers import AddedToken
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    root = tmp_path_factory.mktemp("qwen_vl")
    tok = AutoTokenizer.from_pretrained(tiny.save_qwen_tokenizer(root / "tok"))
    tok.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in VISION_MARKERS]}
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_MARKERS}
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
    model = tiny._perturb(Qwen2_5_VLForConditionalGeneration(config), 5)
    folder = tiny.save(model, root / "text_encoder")

    images = Qwen2VLImageProcessorPil(
        patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=16, max_pixels=20 * 28
    )
    rng = np.random.default_rng(0)
    pictures = [rng.integers(0, 256, (20, 12, 3), np.uint8), rng.integers(0, 256, (8, 16, 3), np.uint8)]
    prompts = [
        "<|im_start|> user \n <|vision_start|><|image_pad|><|vision_end|> a red car <|im_end|>",
        "<|im_start|> user \n a big <|vision_start|><|image_pad|><|vision_end|> cat on the mat at sunset",
    ]
    inputs = dict(images(images=pictures, return_tensors="pt"))
    counts = iter((inputs["image_grid_thw"].prod(-1) // 4).tolist())
    pad = "<|image_pad|>"
    expanded = [
        "".join(
            part + (pad * next(counts) if k < p.count(pad) else "") for k, part in enumerate(p.split(pad))
        )
        for p in prompts
    ]
    inputs.update(tok(expanded, padding=True, return_tensors="pt"))
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == config.image_token_id).int()
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
        visual = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        positions, _ = model.model.get_rope_index(
            inputs["input_ids"],
            inputs["mm_token_type_ids"],
            image_grid_thw=inputs["image_grid_thw"],
            attention_mask=inputs["attention_mask"],
        )
    want = [h.numpy() for h in out.hidden_states]
    return folder, config, model, inputs, want, visual.numpy(), positions.numpy()


@pytest.fixture(scope="module")
def encoder(setup):
    return load_qwen_vl_encoder(setup[0])


def test_processor_input_exercises_windows_and_padding(setup):
    _, _, _, inputs, *_ = setup
    grid = inputs["image_grid_thw"].tolist()
    assert grid == [[1, 10, 6], [1, 4, 8]], grid  # 5x3 and 2x4 merged tokens: windows cut at the edges
    assert inputs["attention_mask"].min() == 0  # one row is padded


def test_vision_tower_matches_transformers(setup):
    _, config, model, inputs, _, visual, _ = setup
    cfg = QwenVisionConfig.from_hf_config(config.to_dict())
    got = run_vision(
        cfg,
        vision_params(model.state_dict(), cfg),
        inputs["pixel_values"].numpy(),
        inputs["image_grid_thw"].tolist(),
    )
    err = _relative(got, visual)
    print(f"vision tower relative error {err:.2e}")
    assert err < BOUND


def test_mrope_positions_match_get_rope_index(setup):
    _, config, _, inputs, _, _, want = setup
    got = mrope_positions(
        inputs["input_ids"].numpy(),
        inputs["attention_mask"].numpy(),
        inputs["image_grid_thw"].tolist(),
        config.image_token_id,
        2,
    )
    mask = inputs["attention_mask"].numpy().astype(bool)
    np.testing.assert_array_equal(got[:, mask], want[:, mask])
    assert (got[1, mask] != got[2, mask]).any()  # rows and columns differ: truly 3-axis


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_hidden_states_match_transformers(setup, encoder, layer):
    _, _, _, inputs, want, _, _ = setup
    got = encoder(
        inputs["input_ids"].numpy(),
        inputs["attention_mask"].numpy(),
        inputs["pixel_values"].numpy(),
        inputs["image_grid_thw"].numpy(),
        layers=layer,
    )
    mask = inputs["attention_mask"].numpy().astype(bool)
    err = _relative(np.asarray(got)[mask], want[layer][mask])
    print(f"hidden_states[{layer}] relative error {err:.2e}")
    assert err < BOUND


def test_one_axis_positions_would_differ(setup):
    """The 3-axis positions matter: transformers run without ``mm_token_type_ids`` falls back to 0..L-1
    positions (what diffusers' edit pipelines pass on transformers 5), and that is far outside the bound."""
    _, _, model, inputs, want, _, _ = setup
    flat_inputs = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        flat = model(**flat_inputs, output_hidden_states=True).hidden_states[-1].numpy()
    mask = inputs["attention_mask"].numpy().astype(bool)
    err = _relative(flat[mask], want[-1][mask])
    print(f"1-D positions instead of 3-axis: relative difference {err:.2e}")
    assert err > 100 * BOUND


def test_bad_inputs_are_refused(setup, encoder):
    _, _, _, inputs, *_ = setup
    ids, mask = inputs["input_ids"].numpy(), inputs["attention_mask"].numpy()
    with pytest.raises(ValueError, match="no pictures"):
        encoder(ids, mask)
    with pytest.raises(ValueError, match="do not match grid_thw"):
        encoder(ids, mask, inputs["pixel_values"].numpy()[:-4], inputs["image_grid_thw"].numpy())
