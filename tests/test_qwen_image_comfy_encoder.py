"""Qwen-Image's text encoder from ComfyUI's split file (``text_encoders/qwen_2.5_vl_7b.safetensors``):
the Qwen2.5-VL text decoder under ``model.``, the vision tower under ``visual.`` and the LM head, in one
safetensors file with no config, as ComfyUI ships it (``comfy/text_encoders/qwen_image.py`` loads it into
``llama.Qwen25_7BVLI``, whose modules are ``model`` and ``visual``).

A tiny random ``Qwen2_5_VLForConditionalGeneration`` whose heads are 128 wide (every Qwen2.5-VL size's, so
its config can be read off the file's shapes), written once as a transformers folder and once in
ComfyUI's layout: the prompt embeddings through the file equal the folder's (the same weights, fp32).
"""

from __future__ import annotations

import dataclasses

import decoder_lm_tiny as tiny
import numpy as np
import pytest
import torch

from converters.errors import CheckpointError
from jaxdit.loading.qwen_image_encoder import load_qwen_image_prompt_encoder, text_encoder_config
from jaxdit.text_encoders.decoder_lm_config import DecoderLMConfig

pytest.importorskip("transformers")

PROMPTS = ["a red car at sunset", "a big dog"]
#: Two 128-wide query heads, one key/value head; mrope sections sum to 128 / 2.
TEXT = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2)


def comfy_key(key: str) -> str:
    """transformers' Qwen2.5-VL key -> ComfyUI's (``model.`` text decoder, ``visual.`` vision tower)."""
    for old, new in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if key.startswith(old):
            return new + key[len(old) :]
    return key  # lm_head.weight, and transformers 4.x's own model./visual. keys


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from safetensors.torch import save_file

    model = tiny.qwen2_5_vl(
        rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}, **TEXT
    )
    root = tmp_path_factory.mktemp("qwen_comfy")
    tiny.save(model, root / "folder" / "text_encoder")
    tiny.save_qwen_tokenizer(root / "folder" / "tokenizer")
    tiny.save_qwen_tokenizer(root / "comfy" / "tokenizer")  # no text_encoder/: the file alone
    state = {comfy_key(k): v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.startswith("visual.") for k in state) and "model.embed_tokens.weight" in state
    file = root / "qwen_2.5_vl_tiny.safetensors"
    save_file(state, file)
    return root, file, state


def test_comfy_file_encodes_as_the_folder(case):
    root, file, _ = case
    want, want_mask = load_qwen_image_prompt_encoder(root / "folder")(PROMPTS)
    got, mask = load_qwen_image_prompt_encoder(root / "comfy", text_encoder=file)(PROMPTS)
    np.testing.assert_array_equal(mask, want_mask)
    assert mask.sum(1).tolist() == [10, 8]
    np.testing.assert_allclose(got, want, rtol=0, atol=0)  # the same weights, the same program


def test_config_read_off_the_file_is_the_folders(case):
    root, file, _ = case
    folder = DecoderLMConfig.from_hf_config(root / "folder" / "text_encoder" / "config.json")
    inferred = text_encoder_config(root / "comfy", file)
    # every size and switch; model_type only labels the text config ("qwen2_5_vl" vs "..._text")
    assert dataclasses.replace(inferred, model_type=folder.model_type) == folder
    assert text_encoder_config(root / "folder", file) == folder  # a folder's config wins


def test_unknown_tensors_are_named(case, tmp_path):
    from safetensors.torch import save_file

    root, _, state = case
    bad = tmp_path / "extra.safetensors"
    save_file({**state, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, bad)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        load_qwen_image_prompt_encoder(root / "comfy", text_encoder=bad)
    with pytest.raises(CheckpointError, match=r"no such \.safetensors file"):
        load_qwen_image_prompt_encoder(root / "comfy", text_encoder=tmp_path / "missing.safetensors")


def test_offloaded_encoder_gives_the_same_embeddings_and_leaves_the_device(case):
    import gc

    import jax
    from flax import nnx

    root, _, _ = case
    resident = load_qwen_image_prompt_encoder(root / "folder")
    offloaded = load_qwen_image_prompt_encoder(root / "folder", offload=True)
    leaves = jax.tree.leaves(nnx.state(offloaded.encoder.model))
    assert leaves and all(x.is_deleted() for x in leaves)  # only the host copy is left
    weights = {x.shape for x in leaves}
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}
    got = offloaded(PROMPTS)
    gc.collect()
    # the call copied the weights in and freed them: no new live array is one of them
    assert not [a.shape for a in jax.live_arrays() if id(a) not in before and a.shape in weights]
    want = resident(PROMPTS)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
