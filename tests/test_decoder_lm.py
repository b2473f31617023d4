"""The decoder-LM text encoder against transformers' own Qwen2, Qwen2.5-VL, Qwen3 and Mistral models: tiny random
models saved with ``save_pretrained`` (one of them sharded), loaded through jaxdit, compared on a batch
of two prompts of different lengths (right padding, only real tokens compared), fp32."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxdit.loading.decoder_lm import load_decoder_lm, map_key  # noqa: E402
from jaxdit.text_encoders.decoder_lm import DecoderLMConfig, encode  # noqa: E402

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)


def _qwen2_5_vl(**text):
    # The whole vision-language model (tiny vision tower included), so the saved folder has the layout
    # people download: the decoder under ``model.``, the vision tower under ``visual.``.
    text = {
        **text,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
    }
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64)
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config={**vision, "fullatt_block_indexes": [0]}
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


FAMILIES = {
    "qwen2": lambda **c: transformers.Qwen2Model(transformers.Qwen2Config(**c, rope_theta=1e6)),
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3": lambda **c: transformers.Qwen3Model(transformers.Qwen3Config(**c, head_dim=24, rope_theta=5e5)),
    "mistral": lambda **c: transformers.MistralModel(transformers.MistralConfig(**c, sliding_window=None)),
}
LENGTHS = (11, 7)
LAYERS = [0, 2, -1]


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory):
    torch.manual_seed(0)
    model = FAMILIES[request.param](**COMMON).eval()
    folder = tmp_path_factory.mktemp(request.param)
    # Qwen2 is saved sharded, the others as one file: both layouts are read.
    model.save_pretrained(folder, max_shard_size="40KB" if request.param == "qwen2" else "1GB")
    ids = np.random.default_rng(1).integers(0, COMMON["vocab_size"], (2, max(LENGTHS)))
    mask = (np.arange(max(LENGTHS))[None] < np.array(LENGTHS)[:, None]).astype(np.int64)
    with torch.no_grad():
        decoder = model.model if request.param == "qwen2_5_vl" else model
        out = decoder(torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True)
        # Left padding too: with right padding the causal mask alone hides the pads from real tokens, so
        # only this makes the padding mask matter (positions stay 0..L-1 in both, as transformers counts).
        left = mask[:, ::-1].copy()
        out_left = decoder(torch.tensor(ids), attention_mask=torch.tensor(left)).last_hidden_state.numpy()
    reference = [h.numpy() for h in out.hidden_states]
    return request.param, folder, ids, mask, out.last_hidden_state.numpy(), reference, (left, out_left)


def test_both_file_layouts_read(case):
    name, folder, *_ = case
    sharded = (folder / "model.safetensors.index.json").is_file()
    assert sharded == (name == "qwen2"), (name, sorted(p.name for p in folder.iterdir()))
    if name == "qwen2_5_vl":  # the vision tower really is in the file, so the skip is exercised
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
            assert any(k.startswith("visual.") for k in f.keys())  # noqa: SIM118


def test_last_layer_matches_transformers(case):
    name, folder, ids, mask, last, *_ = case
    cfg, params = load_decoder_lm(folder)
    got = np.asarray(
        jax.jit(lambda p, i, m: encode(cfg, p, i, m))(params, jnp.asarray(ids), jnp.asarray(mask))
    )
    for row, n in enumerate(LENGTHS):
        err = _relative(got[row, :n], last[row, :n])
        print(f"{name} last layer row {row}: relative error {err:.2e}")
        assert err < 1e-5, (name, row, err)


def test_stacked_layers_match_transformers(case):
    name, folder, ids, mask, _, reference, _ = case
    cfg, params = load_decoder_lm(folder)
    got = np.asarray(encode(cfg, params, jnp.asarray(ids), jnp.asarray(mask), layers=LAYERS))
    assert got.shape == (2, len(LAYERS), max(LENGTHS), COMMON["hidden_size"])
    for j, layer in enumerate(LAYERS):
        for row, n in enumerate(LENGTHS):
            err = _relative(got[row, j, :n], reference[layer][row, :n])
            print(f"{name} hidden_states[{layer}] row {row}: relative error {err:.2e}")
            assert err < 1e-5, (name, layer, row, err)


def test_config_fields_from_transformers(case):
    name, folder, *_ = case
    cfg = DecoderLMConfig.from_hf_config(folder / "config.json")
    assert cfg.attention_bias == name.startswith("qwen2")
    assert cfg.qk_norm == (name == "qwen3")
    assert cfg.head_dim == (24 if name == "qwen3" else 16)
    assert cfg.num_key_value_heads == 2


def test_vision_tower_and_lm_head_skipped_by_name():
    assert map_key("visual.blocks.0.attn.qkv.weight") is None
    assert map_key("model.visual.patch_embed.proj.weight") is None
    assert map_key("lm_head.weight") is None
    assert map_key("model.language_model.layers.3.mlp.up_proj.weight") == ("layers.mlp.up_proj.weight", 3)
    assert map_key("model.norm.weight") == ("norm.weight", None)
    assert map_key("norm.weight") == ("norm.weight", None)


def test_unexpected_and_missing_tensors_refused(case, tmp_path):
    name, folder, *_ = case
    if name != "mistral":
        pytest.skip("the strictness checks need one folder")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    extra = dict(tensors) | {"layers.0.self_attn.rotary.weight": np.zeros(2, np.float32)}
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="rotary"):
        load_decoder_lm(tmp_path)
    fewer = {k: v for k, v in tensors.items() if k != "layers.1.mlp.down_proj.weight"}
    save_file(fewer, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks layers.mlp.down_proj.weight \(layers \[1\]\)"):
        load_decoder_lm(tmp_path)


def test_bad_config_refused():
    with pytest.raises(ValueError, match="model_type 't5'"):
        DecoderLMConfig.from_hf_config({"model_type": "t5"})
    config = json.loads(json.dumps({"model_type": "qwen2", **COMMON, "rope_scaling": {"type": "yarn"}}))
    with pytest.raises(ValueError, match="yarn"):
        DecoderLMConfig.from_hf_config(config)


def test_bfloat16_compute_close_to_transformers(case):
    # bf16 weights and activations, fp32 norms/softmax/accumulation: within bf16's few-ulp reach of fp32.
    name, folder, ids, mask, last, *_ = case
    cfg, params = load_decoder_lm(folder, dtype=jnp.bfloat16)
    got = encode(cfg, params, jnp.asarray(ids), jnp.asarray(mask))
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got.astype(jnp.float32))
    for row, n in enumerate(LENGTHS):
        err = _relative(got[row, :n], last[row, :n])
        print(f"{name} bf16 last layer row {row}: relative error {err:.2e}")
        assert err < 2e-2, (name, row, err)


def test_left_padding_uses_the_padding_mask(case):
    name, folder, ids, _, _, _, (left, reference) = case
    cfg, params = load_decoder_lm(folder)
    got = np.asarray(encode(cfg, params, jnp.asarray(ids), jnp.asarray(left)))
    for row, n in enumerate(LENGTHS):
        err = _relative(got[row, -n:], reference[row, -n:])
        print(f"{name} left-padded row {row}: relative error {err:.2e}")
        assert err < 1e-5, (name, row, err)
