"""Text and image encoders: equivalence with transformers / diffusers, checkpoint layouts, strictness,
device placement.

Tiny random models and tokenizers from ``tiny_text_models.py``; fp32 everywhere; bounds from
tests/tolerance.py (TORCH_FORWARD, BF16). Measured errors are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_text_models as ttm
import tolerance as tol
import torch
from safetensors.numpy import save_file

from converters.clip import TEXT_PREFIX, open_clip_text, open_clip_vision, text_table
from converters.errors import CheckpointError
from converters.keymap import invert
from converters.t5 import WAN_T5_FILE, hf_table, hf_to_params, open_t5, write_wan_original
from jaxdit.loading import wan as wan_loading
from jaxdit.loading.encoders import load_clip_text, load_clip_vision, load_t5
from jaxdit.loading.flux import load_flux_text_encoders
from jaxdit.loading.wan import load_wan_image_encoder, load_wan_text_encoder
from jaxdit.text_encoders import (
    CLIPTextConfig,
    CLIPVisionConfig,
    T5Config,
    prompt_clean,
)
from jaxdit.text_encoders.clip import abstract_text_model, abstract_vision_model
from jaxdit.text_encoders.common import jit_forward, parameter_shapes
from jaxdit.text_encoders.t5 import abstract_model as abstract_t5
from jaxdit.text_encoders.t5 import relative_position_buckets

#: A CLIP text config whose eos_token_id is neither 2 nor the largest id: pooling must find the first one.
MID_EOS = 300
FAST = {"xla_backend_optimization_level": 0}
PROMPTS = [
    "a photo of a cat on the mat",
    "  Zebra!  big   RED car at sunset, with &amp; émoji ✨ and a very long tail of words words words",
]


def _np(sd) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in sd.items()}


def _err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_encoders")
    ttm.save_tiny_flux_text(root / "flux")
    ttm.save_tiny_wan_text(root / "wan", i2v=True)
    ttm.save_tiny_clip_text(root / "clip_eos", legacy_eos=False, eos_token_id=MID_EOS)
    return root


# ------------------------------------------------------------------------------------------- configs


def test_presets_match_the_real_configs():
    # The config.json values of google/t5-v1_1-xxl, google/umt5-xxl, FLUX's CLIP-L text encoder and
    # Wan I2V's image encoder (laion ViT-H/14 as CLIPVisionModel).
    t5 = dict(model_type="t5", vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
              num_heads=64, feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
              relative_attention_max_distance=128, layer_norm_epsilon=1e-6)  # fmt: skip
    assert T5Config.from_hf_config(t5) == T5Config.preset("t5-v1_1-xxl")
    assert T5Config.from_hf_config({**t5, "model_type": "umt5", "vocab_size": 256384}) == T5Config.preset(
        "umt5-xxl"
    )
    clip_l = dict(model_type="clip_text_model", vocab_size=49408, hidden_size=768, intermediate_size=3072,
                  num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
                  hidden_act="quick_gelu", layer_norm_eps=1e-5, eos_token_id=2)  # fmt: skip
    assert CLIPTextConfig.from_hf_config(clip_l) == CLIPTextConfig.preset("clip-vit-large-patch14")
    vit_h = dict(model_type="clip_vision_model", hidden_size=1280, intermediate_size=5120,
                 num_hidden_layers=32, num_attention_heads=16, image_size=224, patch_size=14,
                 hidden_act="gelu", layer_norm_eps=1e-5)  # fmt: skip
    assert CLIPVisionConfig.from_hf_config(vit_h) == CLIPVisionConfig.preset("clip-vit-huge-14")
    with pytest.raises(ValueError, match="gated"):
        T5Config.from_hf_config({**t5, "feed_forward_proj": "relu"})


def test_full_size_parameter_counts_and_tables():
    """Abstract full-size models: published parameter counts, and every parameter has exactly one rule."""

    def count(model):
        return sum(int(np.prod(s)) for s in parameter_shapes(model).values())

    t5 = abstract_t5(T5Config.preset("t5-v1_1-xxl"))
    umt5 = abstract_t5(T5Config.preset("umt5-xxl"))
    # transformers T5EncoderModel / UMT5EncoderModel at these configs (tied embedding counted once).
    assert count(t5) == 4_762_310_656
    assert count(umt5) == 5_680_910_336
    assert count(abstract_text_model(CLIPTextConfig.preset("clip-vit-large-patch14"))) == 123_060_480
    vision = abstract_vision_model(CLIPVisionConfig.preset("clip-vit-huge-14"))
    assert count(vision) == 630_766_080  # transformers CLIPVisionModel at ViT-H/14 size
    assert len(hf_table(T5Config.preset("t5-v1_1-xxl")).source_keys()) == 219
    assert len(hf_table(T5Config.preset("umt5-xxl")).source_keys()) == 242
    assert set(text_table(CLIPTextConfig()).targets) == set(
        parameter_shapes(abstract_text_model(CLIPTextConfig()))
    )


@pytest.mark.parametrize("name", ["umt5-xxl", "clip-vit-huge-14"])
def test_full_size_lowers_with_one_scanned_block(name):
    """Full-size encoders (bf16, abstract: nothing allocated) lower to a program with ONE block in a loop,
    whatever the depth, and give the real output shapes."""
    from flax import nnx

    if name == "umt5-xxl":
        model = abstract_t5(T5Config.preset(name), jnp.bfloat16)
        arg = jax.ShapeDtypeStruct((1, 512), jnp.int32)
        fn, want = (lambda m, i: m(i, i)), (1, 512, 4096)
    else:
        model = abstract_vision_model(CLIPVisionConfig.preset(name), jnp.bfloat16)
        arg = jax.ShapeDtypeStruct((1, 3, 224, 224), jnp.float32)
        fn, want = (lambda m, x: m(x, hidden_layer=-2)), (1, 257, 1280)
    graphdef, state = nnx.split(model)
    lowered = jax.jit(lambda st, x: fn(nnx.merge(graphdef, st), x)).lower(state, arg)
    assert lowered.out_info.shape == want
    assert lowered.as_text().count("stablehlo.while") == 1


def test_relative_position_buckets_match_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    # Buckets depend on key - query only: the first row and column cover every distance up to 599.
    for nb, md in ((32, 128), (8, 20)):
        grid = relative_position_buckets(600, nb, md)
        ours = np.concatenate([grid[:0:-1, 0], grid[0]])  # distances -599 .. 599
        rel = torch.arange(-599, 600)
        ref = T5Attention._relative_position_bucket(rel, bidirectional=True, num_buckets=nb, max_distance=md)
        np.testing.assert_array_equal(ours, ref.numpy())


# ------------------------------------------------------------------------------ models vs transformers


@pytest.mark.parametrize("kind", ["t5", "umt5"])
def test_t5_matches_transformers(root, kind):
    folder = root / ("flux/text_encoder_2" if kind == "t5" else "wan/text_encoder")
    ref_model = (ttm.tiny_t5() if kind == "t5" else ttm.tiny_umt5()).eval()
    ours = load_t5(folder, dtype=jnp.float32)
    assert ours.config.per_layer_position_bias == (kind == "umt5")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ours.config.vocab_size, (2, 45))
    mask = np.ones_like(ids)
    mask[1, 30:] = 0
    fwd = jit_forward(ours, lambda m, i, k: m(i, k), FAST)
    with torch.no_grad():
        for m in (mask, None):
            ref = ref_model(
                input_ids=torch.tensor(ids), attention_mask=None if m is None else torch.tensor(m)
            ).last_hidden_state.numpy()
            out = fwd(jnp.asarray(ids), None if m is None else jnp.asarray(m))
            tol.check(out, ref, tol.TORCH_FORWARD, f"{kind} last_hidden_state (mask={m is not None})")


@pytest.mark.parametrize("legacy", [True, False])
def test_clip_text_matches_transformers(root, legacy):
    folder = root / ("flux/text_encoder" if legacy else "clip_eos")
    ref_model = ttm.tiny_clip_text(legacy_eos=legacy, **({} if legacy else {"eos_token_id": MID_EOS}))
    ours = load_clip_text(folder)
    assert ours.config.eos_token_id == (2 if legacy else MID_EOS)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, ttm.clip_tokenizer().eos_token_id, (3, 77))
    ids[ids == MID_EOS] = 0
    if not legacy:
        # The first MID_EOS, wherever the largest id is (legacy argmax would pick another position).
        ids[0, [5, 9]] = MID_EOS
        ids[1, 70] = MID_EOS
        ids[2, 0] = MID_EOS
        assert not np.array_equal(np.argmax(ids, -1), np.argmax(ids == MID_EOS, -1))
    fwd = jit_forward(ours, lambda m, i: m(i), FAST)
    hidden, pooled = fwd(jnp.asarray(ids))
    with torch.no_grad():
        ref = ref_model(input_ids=torch.tensor(ids))
    what = f"CLIP text (legacy eos={legacy})"
    tol.check(hidden, ref.last_hidden_state.numpy(), tol.TORCH_FORWARD, f"{what}: last_hidden_state")
    tol.check(pooled, ref.pooler_output.numpy(), tol.TORCH_FORWARD, f"{what}: pooler_output")


def test_clip_vision_matches_transformers(root):
    ref_model = ttm.tiny_clip_vision()
    ours = load_clip_vision(root / "wan/image_encoder")
    px = np.random.default_rng(2).standard_normal((2, 3, 28, 28)).astype(np.float32)
    with torch.no_grad():
        ref = ref_model(pixel_values=torch.tensor(px), output_hidden_states=True)
    fwd = jit_forward(
        ours, lambda m, x: (m(x, hidden_layer=-2), m(x), m(x, hidden_layer=0), m.pooled(x)), FAST
    )
    penult, last, first, pooled = fwd(jnp.asarray(px))
    tol.check(penult, ref.hidden_states[-2].numpy(), tol.TORCH_FORWARD, "CLIP vision: hidden_states[-2]")
    tol.check(last, ref.last_hidden_state.numpy(), tol.TORCH_FORWARD, "CLIP vision: hidden_states[-1]")
    tol.check(first, ref.hidden_states[0].numpy(), tol.TORCH_FORWARD, "CLIP vision: hidden_states[0]")
    tol.check(pooled, ref.pooler_output.numpy(), tol.TORCH_FORWARD, "CLIP vision: pooler_output")


# --------------------------------------------------------------------------------- prompt encoders


def test_flux_text_encoders_match_diffusers_on_a_chosen_device(root):
    from diffusers import FluxPipeline
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    folder = root / "flux"
    pipe = FluxPipeline(
        scheduler=None,
        vae=None,
        text_encoder=CLIPTextModel.from_pretrained(folder / "text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(folder / "tokenizer"),
        text_encoder_2=T5EncoderModel.from_pretrained(folder / "text_encoder_2"),
        tokenizer_2=AutoTokenizer.from_pretrained(folder / "tokenizer_2"),
        transformer=None,
    )
    with torch.no_grad():
        ref_embeds, ref_pooled, _ = pipe.encode_prompt(PROMPTS, prompt_2=None, max_sequence_length=24)
    device = jax.devices()[7]
    enc = load_flux_text_encoders(folder, device=device, compiler_options=FAST)
    embeds, pooled = enc(PROMPTS, max_sequence_length=24)
    assert embeds.dtype == np.float32 and embeds.shape == (2, 24, 32) and pooled.shape == (2, 32)
    what = "FluxTextEncoders vs FluxPipeline.encode_prompt"
    tol.check(embeds, ref_embeds.numpy(), tol.TORCH_FORWARD, f"{what}: prompt_embeds")
    tol.check(pooled, ref_pooled.numpy(), tol.TORCH_FORWARD, f"{what}: pooled")
    # Everything lives and runs on the device asked for.
    on_device = enc.encode(PROMPTS, max_sequence_length=24)
    assert all(x.devices() == {device} for x in on_device)
    assert enc.device == device and enc.clip_device == device


def test_wan_text_encoder_matches_diffusers(root):
    from diffusers import WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel

    folder = root / "wan"
    pipe = WanPipeline(
        tokenizer=AutoTokenizer.from_pretrained(folder / "tokenizer"),
        text_encoder=UMT5EncoderModel.from_pretrained(folder / "text_encoder"),
        vae=None,
        scheduler=None,
    )
    with torch.no_grad():
        ref, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=40)
    device = jax.devices()[5]
    enc = load_wan_text_encoder(folder, device=device, compiler_options=FAST)
    out = enc(PROMPTS, max_sequence_length=40)
    assert out.shape == (2, 40, 16) and out.dtype == np.float32
    tol.check(out, ref.numpy(), tol.TORCH_FORWARD, "WanTextEncoder vs WanPipeline.encode_prompt")
    # Rows beyond each prompt's tokens are exactly zero (diffusers pads back with zeros).
    _, mask = enc.tokenize(PROMPTS, 40)
    assert np.all(out[mask == 0] == 0) and np.all(np.any(out[mask == 1] != 0, axis=-1))
    assert enc.encode(PROMPTS, 40).devices() == {device}


def test_prompt_clean_mirrors_diffusers():
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean as reference

    for text in PROMPTS + ["tab\there\nnewline", "&lt;b&gt; &amp;amp; x  ", "\u3000wide\u00a0space "]:
        assert prompt_clean(text) == reference(text)


def test_wan_original_pth_layout(root, tmp_path):
    """Wan's original folder: the umT5 .pth (written through the inverted Wan table) + google/umt5-xxl."""
    src = root / "wan"
    model = ttm.tiny_umt5()
    cfg = T5Config.from_hf_config(model.config.to_dict())
    wan_sd = write_wan_original(cfg, hf_to_params(cfg, _np(model.state_dict())))
    # Wan's own names, as wan/modules/t5.py's T5Encoder (shared_pos=False) registers them.
    assert {"token_embedding.weight", "norm.weight", "blocks.2.pos_embedding.embedding.weight",
            "blocks.0.ffn.gate.0.weight", "blocks.0.ffn.fc1.weight", "blocks.0.ffn.fc2.weight",
            "blocks.1.attn.o.weight", "blocks.1.norm2.weight"} <= set(wan_sd)  # fmt: skip
    assert len(wan_sd) == 2 + 3 * 10
    orig = tmp_path / "Wan2.1-T2V-tiny"
    orig.mkdir()
    torch.save({k: torch.from_numpy(v) for k, v in wan_sd.items()}, orig / WAN_T5_FILE)
    shutil.copytree(src / "tokenizer", orig / "google" / "umt5-xxl")
    assert open_t5(orig / WAN_T5_FILE).config == cfg  # inferred from the shapes

    ref = load_wan_text_encoder(src, compiler_options=FAST)(PROMPTS, 32)
    out = load_wan_text_encoder(orig, compiler_options=FAST)(PROMPTS, 32)
    print(f"Wan original .pth vs diffusers folder: {_err(out, ref):.2e}")
    np.testing.assert_array_equal(out, ref)

    # bf16 (the real file's dtype) stays bf16 on the way in (ml_dtypes view of the mmap).
    torch.save({k: torch.from_numpy(v).bfloat16() for k, v in wan_sd.items()}, tmp_path / "bf16.pth")
    bf16 = open_t5(tmp_path / "bf16.pth")
    assert bf16.dtype == jnp.bfloat16
    loaded = load_t5(tmp_path / "bf16.pth")
    assert loaded.embed[...].dtype == jnp.bfloat16
    expect = torch.from_numpy(wan_sd["token_embedding.weight"]).bfloat16().float().numpy()
    np.testing.assert_array_equal(np.asarray(loaded.embed[...], np.float32), expect)


def test_wan_image_encoder_matches_diffusers(root):
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPVisionModel

    folder = root / "wan"
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, (40, 52, 3), dtype=np.uint8)) for _ in range(2)]
    # WanImageToVideoPipeline.encode_image: processor -> CLIPVisionModel -> hidden_states[-2].
    processor = CLIPImageProcessor.from_pretrained(folder / "image_processor")
    vision = CLIPVisionModel.from_pretrained(folder / "image_encoder").eval()
    with torch.no_grad():
        pixels = processor(images=images, return_tensors="pt")
        ref = vision(**pixels, output_hidden_states=True).hidden_states[-2].numpy()
    device = jax.devices()[6]
    enc = load_wan_image_encoder(folder, device=device, compiler_options=FAST)
    out = enc(images)
    assert out.shape == (2, 5, 24)
    tol.check(out, ref, tol.TORCH_FORWARD, "WanImageEncoder vs encode_image (hidden_states[-2])")
    assert enc.encode(images).devices() == {device}


# ------------------------------------------------------------------------------- checkpoint layouts


def test_tied_embedding_keys(tmp_path, root):
    model = ttm.tiny_t5()
    sd = _np(model.state_dict())
    cfg = T5Config.from_hf_config(model.config.to_dict())
    expected = parameter_shapes(abstract_t5(cfg))
    shared = sd["shared.weight"]
    for name, tensors in {
        "both": {**sd, "encoder.embed_tokens.weight": shared},
        "alias_only": {
            **{k: v for k, v in sd.items() if k != "shared.weight"},
            "encoder.embed_tokens.weight": shared,
        },
    }.items():
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(root / "flux/text_encoder_2/config.json", folder)
        save_file(tensors, str(folder / "model.safetensors"))
        got = np.asarray(open_t5(folder).resolve(expected)["embed"])
        np.testing.assert_array_equal(got, shared)
    untied = tmp_path / "untied"
    untied.mkdir()
    shutil.copy(root / "flux/text_encoder_2/config.json", untied)
    other = shared.copy()
    other[-1] += 1.0
    save_file({**sd, "encoder.embed_tokens.weight": other}, str(untied / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"encoder\.embed_tokens\.weight.*differs"):
        open_t5(untied)


def test_sharded_t5_folder_and_bf16_weights(tmp_path, root):
    """A sharded transformers folder (index + shards) loads the same weights; dtype= casts them."""
    ttm.tiny_t5().save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    cfg = open_t5(tmp_path / "sharded").config
    shapes = parameter_shapes(abstract_t5(cfg))
    single = open_t5(root / "flux/text_encoder_2").resolve(shapes)
    for path, t in open_t5(tmp_path / "sharded").resolve(shapes).items():
        np.testing.assert_array_equal(np.asarray(t), np.asarray(single[path]))

    ids = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (1, 30)))
    f32 = load_t5(tmp_path / "sharded")
    bf16 = load_t5(tmp_path / "sharded", dtype=jnp.bfloat16)
    assert f32.blocks.q.kernel[...].dtype == jnp.float32 and bf16.blocks.q.kernel[...].dtype == jnp.bfloat16
    assert f32.embed[...].devices() == {jax.local_devices()[0]}  # the default device
    ref = jit_forward(f32, lambda m, i: m(i), FAST)(ids)
    out = jit_forward(bf16, lambda m, i: m(i), FAST)(ids)
    assert out.dtype == jnp.float32  # the residual stream and final norm stay fp32
    tol.check(out, ref, tol.BF16, "T5 bf16 weights vs fp32")


def test_transformers4_clip_layout_with_prefix_and_position_ids(tmp_path, root):
    """Hub files (transformers 4) prefix keys with text_model. and may keep the position_ids buffer."""
    model = ttm.tiny_clip_text()
    cfg = CLIPTextConfig.from_hf_config(model.config.to_dict())
    params = {k: np.asarray(v) for k, v in open_clip_text(root / "flux/text_encoder").resolve(
        parameter_shapes(abstract_text_model(cfg))).items()}  # fmt: skip
    old = invert(text_table(cfg, TEXT_PREFIX), params)
    old[TEXT_PREFIX + "embeddings.position_ids"] = np.arange(77)[None]
    folder = tmp_path / "old"
    folder.mkdir()
    shutil.copy(root / "flux/text_encoder/config.json", folder)
    save_file(old, str(folder / "model.safetensors"))
    opened = open_clip_text(folder)
    assert opened.prefix == TEXT_PREFIX
    for path, t in opened.resolve(parameter_shapes(abstract_text_model(cfg))).items():
        np.testing.assert_array_equal(np.asarray(t), params[path])
    old[TEXT_PREFIX + "embeddings.position_ids"] = np.arange(77)[None][:, ::-1].copy()
    save_file(old, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="position_ids"):
        open_clip_text(folder)


def test_with_projection_checkpoint_consumes_its_head(tmp_path, root):
    """A CLIPVisionModelWithProjection folder (projection head included) loads the vision tower; the
    same tensor in a plain CLIPVisionModel folder is an unused key."""
    from safetensors.numpy import load_file

    src = root / "wan/image_encoder"
    tensors = load_file(str(src / "model.safetensors"))
    tensors["visual_projection.weight"] = np.zeros((12, 24), np.float32)
    folder = tmp_path / "with_projection"
    folder.mkdir()
    config = json.loads((src / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "architectures": ["CLIPVisionModelWithProjection"]})
    )
    save_file(tensors, str(folder / "model.safetensors"))
    shapes = parameter_shapes(abstract_vision_model(open_clip_vision(src).config))
    plain = open_clip_vision(src).resolve(shapes)
    for path, t in open_clip_vision(folder).resolve(shapes).items():
        np.testing.assert_array_equal(np.asarray(t), np.asarray(plain[path]))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="visual_projection.weight"):
        open_clip_vision(folder).resolve(shapes)


def _corrupt(folder, src, edit):
    shutil.copytree(src, folder)
    from safetensors.numpy import load_file

    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize(
    ("which", "key", "edit", "match"),
    [
        ("t5", "encoder.block.1.layer.1.DenseReluDense.wo.weight", "drop", "missing tensor"),
        ("t5", "encoder.block.0.layer.0.SelfAttention.q.weight", "shape", "shape"),
        ("t5", "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight", "extra", "not used"),
        ("clip", "encoder.layers.1.mlp.fc1.bias", "drop", "missing tensor"),
        ("clip", "encoder.layers.0.self_attn.out_proj.weight", "shape", "shape"),
        ("clip", "text_projection.weight", "extra", "not used"),
        ("vision", "embeddings.patch_embedding.weight", "shape", "shape"),
    ],
)
def test_corrupt_checkpoints_name_the_key_and_file(tmp_path, root, which, key, edit, match):
    src = {
        "t5": root / "flux/text_encoder_2",
        "clip": root / "flux/text_encoder",
        "vision": root / "wan/image_encoder",
    }[which]

    def change(t):
        if edit == "drop":
            del t[key]
        elif edit == "shape":
            t[key] = np.concatenate([t[key], t[key][:1]], axis=0)
        else:
            t[key] = np.zeros((4, 4), np.float32)

    folder = _corrupt(tmp_path / "bad", src, change)
    opened = {"t5": open_t5, "clip": open_clip_text, "vision": open_clip_vision}[which](folder)
    abstract = {
        "t5": lambda c: abstract_t5(c),
        "clip": abstract_text_model,
        "vision": abstract_vision_model,
    }[which](opened.config)
    with pytest.raises(CheckpointError, match=match) as info:
        opened.resolve(parameter_shapes(abstract))
    assert key in str(info.value) and str(folder) in str(info.value)


@pytest.mark.parametrize(
    ("edit", "key", "match"),
    [
        ("drop", "blocks.1.ffn.gate.0.weight", "missing tensor"),
        ("shape", "blocks.0.attn.k.weight", "shape"),
        ("extra", "pos_embedding.embedding.weight", "not used"),
    ],
)
def test_corrupt_wan_pth(tmp_path, edit, key, match):
    model = ttm.tiny_umt5()
    cfg = T5Config.from_hf_config(model.config.to_dict())
    sd = write_wan_original(cfg, hf_to_params(cfg, _np(model.state_dict())))
    if edit == "drop":
        del sd[key]
    elif edit == "shape":
        sd[key] = sd[key][:-1]
    else:
        sd[key] = np.zeros((8, 4), np.float32)
    path = tmp_path / WAN_T5_FILE
    torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, path)
    with pytest.raises(CheckpointError, match=match) as info:
        open_t5(path, config=cfg).resolve(parameter_shapes(abstract_t5(cfg)))
    assert key in str(info.value) and str(path) in str(info.value)


def test_pth_reading_is_weights_only(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("unpickled!",))

    path = tmp_path / "evil.pth"
    torch.save({"token_embedding.weight": torch.zeros(2, 2), "x": Payload()}, path)
    with pytest.raises(CheckpointError, match="weights-only"):
        open_t5(path)
    torch.save([torch.zeros(2)], tmp_path / "list.pth")
    with pytest.raises(CheckpointError, match="not a state dict"):
        open_t5(tmp_path / "list.pth")


def test_missing_torch_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch":
            raise ImportError("no torch here")
        return real_import(name, *args, **kwargs)

    (tmp_path / WAN_T5_FILE).write_bytes(b"")
    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(ImportError, match="needs PyTorch"):
        open_t5(tmp_path / WAN_T5_FILE)


def test_folder_errors(tmp_path):
    with pytest.raises(CheckpointError, match="neither a diffusers WanPipeline folder"):
        load_wan_text_encoder(tmp_path)
    with pytest.raises(CheckpointError, match="no such file"):
        load_flux_text_encoders(tmp_path / "nowhere")
    assert wan_loading.WAN_T5_FILE == WAN_T5_FILE
