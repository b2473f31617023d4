"""The decoder-LM text encoder (Qwen2.5-VL text, Qwen3, Mistral) against transformers' own models.

Tiny random models from ``decoder_lm_tiny.py`` saved with ``save_pretrained`` in several shards, loaded
through the converters; one batch holds prompts of different lengths, right-padded and left-padded (a
left-padded row's real tokens see padding keys before them, so only the mask keeps them out). fp32 unless
said; bounds from tests/tolerance.py, errors printed (``pytest -s``).
"""

from __future__ import annotations

import json

import decoder_lm_tiny as tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
import torch

from converters.decoder_lm import open_decoder_lm
from converters.errors import CheckpointError
from converters.safetensors_io import write_safetensors
from jaxdit.loading.decoder_lm import load_decoder_lm
from jaxdit.mesh import ParallelConfig
from jaxdit.text_encoders.decoder_lm import DecoderLMRunner, parameter_bytes_per_device
from jaxdit.text_encoders.decoder_lm_config import DecoderLMConfig

LENGTH = 7
#: Row 0 full, row 1 right-padded to 4 tokens, row 2 left-padded (5 tokens after 2 pads), row 3 one token.
MASK = np.array([[1] * 7, [1] * 4 + [0] * 3, [0] * 2 + [1] * 5, [1] + [0] * 6], np.int32)
IDS = np.random.default_rng(0).integers(1, tiny.TEXT["vocab_size"], MASK.shape)
#: transformers' hidden_states indices compared: embeddings, a middle layer, the last layer's normed output.
LAYERS = (0, 2, 3)


def _reference(model: torch.nn.Module) -> list[np.ndarray]:
    with torch.no_grad():
        out = tiny.decoder(model)(
            input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK), output_hidden_states=True
        )
    return [h.numpy() for h in out.hidden_states]


def _real(x) -> np.ndarray:
    """The real (unpadded) tokens of [B, L, E] hidden states, [tokens, E]."""
    return np.asarray(x, np.float32)[MASK.astype(bool)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (folder, transformers hidden states) for each layout."""
    root = tmp_path_factory.mktemp("decoder_lm")
    out = {}
    for name, build in tiny.BUILDERS.items():
        model = build()
        out[name] = (tiny.save(model, root / name), _reference(model))
        if name == "mistral":  # the scaled RoPE must be what transformers ran, or the test proves nothing
            assert model.rotary_emb.rope_type == "llama3"
    return out


@pytest.fixture(scope="module")
def qwen_one_device(saved):
    folder, _ = saved["qwen2_5_vl"]
    return DecoderLMRunner(load_decoder_lm(folder))


@pytest.mark.parametrize("name", list(tiny.BUILDERS))
def test_hidden_states_match_transformers(saved, name):
    folder, want = saved[name]
    runner = DecoderLMRunner(load_decoder_lm(folder))
    last = runner(IDS, MASK)
    tol.check(_real(last), _real(want[-1]), tol.TORCH_FORWARD, f"{name} last hidden state")
    stacked = runner(IDS, MASK, layers=LAYERS)
    assert stacked.shape == (len(MASK), len(LAYERS), LENGTH, tiny.TEXT["hidden_size"])
    for j, i in enumerate(LAYERS):
        tol.check(_real(stacked[:, j]), _real(want[i]), tol.TORCH_FORWARD, f"{name} hidden_states[{i}]")


def test_vision_tower_and_lm_head_are_skipped_by_name(saved):
    opened = open_decoder_lm(saved["qwen2_5_vl"][0])
    index = json.loads((saved["qwen2_5_vl"][0] / "model.safetensors.index.json").read_text())
    vision = [k for k in index["weight_map"] if k.startswith("visual.")]
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert opened.skipped == {"vision tower": len(vision), "LM head": 1} and vision
    assert opened.prefix == "model." and opened.config.qkv_bias and opened.config.rope_theta == 1e6
    assert open_decoder_lm(saved["mistral"][0]).prefix == ""


def test_tensor2_mesh_matches_one_device(saved, qwen_one_device):
    folder, want = saved["qwen2_5_vl"]
    mesh = ParallelConfig(tensor=2).make_mesh(jax.devices()[:2])
    model = load_decoder_lm(folder, mesh=mesh)
    # Each device holds half the query heads and half the MLP (read from its own slice of the file).
    q = model.layers.q_proj.kernel[...]
    assert q.addressable_shards[0].data.shape == (3, 32, 16) and q.sharding.spec[-1] == "tensor"
    runner = DecoderLMRunner(model, mesh)
    got = runner(IDS, MASK, layers=LAYERS)
    ref = qwen_one_device(IDS, MASK, layers=LAYERS)
    tol.check(_real(got[:, -1]), _real(ref[:, -1]), tol.SHARDED, "tensor2 vs one device")
    tol.check(_real(got[:, -1]), _real(want[-1]), tol.TORCH_FORWARD, "tensor2 vs transformers")


def test_every_axis_mesh_pads_batch_and_sequence(saved, qwen_one_device):
    """cfg2 x ring2 x tensor2: 4 prompts over cfg, 7 tokens padded to 8 over ring, heads over tensor."""
    folder, _ = saved["qwen2_5_vl"]
    mesh = ParallelConfig(cfg=2, ring=2, tensor=2).make_mesh()
    runner = DecoderLMRunner(load_decoder_lm(folder, mesh=mesh), mesh)
    got = runner(IDS[:3], MASK[:3])  # 3 prompts: padded to 4 over cfg
    ref = qwen_one_device(IDS[:3], MASK[:3])
    assert got.shape == ref.shape == (3, LENGTH, tiny.TEXT["hidden_size"])
    real = MASK[:3].astype(bool)
    tol.check(np.asarray(got)[real], np.asarray(ref)[real], tol.SHARDED, "cfg2 x ring2 x tensor2")


def test_bf16_against_fp32_transformers(saved):
    folder, want = saved["qwen2_5_vl"]
    model = load_decoder_lm(folder, dtype=jnp.bfloat16)
    assert model.layers.q_proj.kernel[...].dtype == jnp.bfloat16
    got = DecoderLMRunner(model)(IDS, MASK)
    assert got.dtype == jnp.float32  # norms and the residual stream stay fp32
    tol.check(_real(got), _real(want[-1]), tol.BF16, "bf16 vs fp32 transformers")


def test_strict_loading(saved, tmp_path):
    folder = saved["qwen3"][0]
    # A tensor no rule consumes and no skipped group names (the shards copied without their index).
    extra = tmp_path / "extra"
    extra.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".json" or f.name == "config.json":
            (extra / f.name).write_bytes(f.read_bytes())
    write_safetensors(
        extra / "model.safetensors", {"model.layers.0.self_attn.rotary.weight": np.ones(4, np.float32)}
    )
    with pytest.raises(CheckpointError, match=r"rotary\.weight.*not used"):
        load_decoder_lm(extra)
    with pytest.raises(CheckpointError, match="not a decoder-LM text encoder config.*t5"):
        bad = tmp_path / "t5"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({"model_type": "t5"}))
        open_decoder_lm(bad)
    with pytest.raises(ValueError, match="tensor=4.*2 key/value heads.*valid tensor degrees: 1, 2"):
        load_decoder_lm(folder, mesh=ParallelConfig(tensor=4).make_mesh(jax.devices()[:4]))
    with pytest.raises(ValueError, match="out of range for a 3-layer encoder"):
        DecoderLMRunner(load_decoder_lm(folder))(IDS, MASK, layers=(1, 4))


def test_config_from_transformers_4_layout():
    """Qwen-Image's text_encoder/config.json as transformers 4.x wrote it: text fields at top level,
    rope_theta and an mrope rope_scaling beside them."""
    old = {
        "model_type": "qwen2_5_vl",
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "hidden_act": "silu",
        "sliding_window": 32768,
        "use_sliding_window": False,
        "vision_config": {"depth": 32},
    }
    assert DecoderLMConfig.from_hf_config(old) == DecoderLMConfig.preset("qwen2.5-vl-7b")


def test_memory_table_qwen2_5_vl_7b():
    """Parameter bytes per device at tensor 1/2/4 (bf16, abstract shapes), against transformers' own
    count of Qwen2.5-VL-7B's text model built on the meta device."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    cfg = DecoderLMConfig.preset("qwen2.5-vl-7b")
    hf = Qwen2_5_VLTextConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
    )
    with torch.device("meta"):
        count = sum(p.numel() for p in Qwen2_5_VLTextModel(hf).parameters())
    table = {t: parameter_bytes_per_device(cfg, jnp.bfloat16, t) for t in (1, 2, 4)}
    print(
        "Qwen2.5-VL-7B text encoder, bf16 GiB per device:", {t: round(b / 2**30, 2) for t, b in table.items()}
    )
    assert table[1] == 2 * count
    embed = 2 * cfg.vocab_size * cfg.hidden_size  # replicated; norms too (a few KiB)
    norms = 2 * (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size
    for t in (2, 4):
        assert table[t] == embed + norms + (table[1] - embed - norms) // t
