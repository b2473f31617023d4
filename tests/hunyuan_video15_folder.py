"""A tiny random diffusers ``HunyuanVideo15Pipeline`` folder (transformer, VAE, scheduler, guider; no text
encoders: calls take embeddings) and embeddings for it."""

from __future__ import annotations

from pathlib import Path

import hunyuan_video15_tiny as tiny
import numpy as np
import torch

#: 4 latent channels (the transformer takes 4 + 4 + 1), the real 16x / 4x compression, widths 8-16.
VAE = dict(latent_channels=4, block_out_channels=(8, 8, 16, 16, 16), layers_per_block=1)
TRANSFORMER = dict(in_channels=9, out_channels=4, patch_size=1, target_size=64)
SHIFT, GUIDANCE = 5.0, 6.0


def pipeline(encoders: dict | None = None, **transformer):
    """The tiny pipeline; ``encoders``: its four text components (:func:`text_encoders`), else None;
    ``transformer``: overrides of the tiny transformer's config (``num_layers=3``)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
    )

    transformer = tiny.transformer(**{**TRANSFORMER, **transformer})
    torch.manual_seed(1)
    vae = AutoencoderKLHunyuanVideo15(**VAE).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    text = encoders or dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    return HunyuanVideo15Pipeline(
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE),
        **text,
    )


#: The tiny SigLIP image encoder (width = the transformer's image_embed_dim) and its processor: 12 x 12
#: pixels in 4 x 4 patches, 9 image tokens (padded on a 4-way sequence split).
SIGLIP = dict(
    hidden_size=12,
    intermediate_size=20,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=12,
    patch_size=4,
)


def image_components() -> dict:
    """``image_encoder`` (a perturbed random ``SiglipVisionModel``) and ``feature_extractor``."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(4)
    encoder = SiglipVisionModel(SiglipVisionConfig(**SIGLIP)).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in encoder.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    size = {"height": SIGLIP["image_size"], "width": SIGLIP["image_size"]}
    return dict(image_encoder=encoder, feature_extractor=SiglipImageProcessor(size=size))


def save_i2v(folder: Path, **transformer):
    """The tiny ``HunyuanVideo15ImageToVideoPipeline`` (text encoders included) saved in ``folder``;
    ``transformer``: overrides of the tiny transformer's config (``use_meanflow=True``)."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    t2v = pipeline(text_encoders(folder.parent), **transformer)
    pipe = HunyuanVideo15ImageToVideoPipeline(**t2v.components, **image_components())
    pipe.save_pretrained(folder)
    return pipe


def save(folder: Path, with_text: bool = False, **transformer):
    """The tiny pipeline saved in ``folder`` (with its text encoders when ``with_text``, ``transformer``
    overrides of its config); returns it."""
    pipe = pipeline(text_encoders(folder.parent) if with_text else None, **transformer)
    pipe.save_pretrained(folder)
    return pipe


def embeddings(lengths, glyph_lengths, text=6, glyph=4, seed=0, prefix=""):
    """One branch's embeddings as the pipeline's call takes them (zero features past each mask)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, n, dim, counts in (
        ("prompt_embeds", text, tiny.CONFIG["text_embed_dim"], lengths),
        ("prompt_embeds_2", glyph, tiny.CONFIG["text_embed_2_dim"], glyph_lengths),
    ):
        mask = (np.arange(n)[None] < np.asarray(counts)[:, None]).astype(np.int64)
        x = (rng.standard_normal((len(counts), n, dim)) * mask[..., None]).astype(np.float32)
        mask_name = name.replace("prompt_embeds", "prompt_embeds_mask")
        out[prefix + name], out[prefix + mask_name] = x, mask
    return out


#: A chat template in Qwen2's format (no tool or vision branches). Ten filler tokens after the system
#: message make its prefix the 108 tokens diffusers drops (Qwen's own tokenizer gives that count).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m['role'] == 'system' %} . . . . . . . . . .{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = [
    "system",
    "user",
    "assistant",
    "You",
    "are",
    "a",
    "helpful",
    ".",
    "Describe",
    "the",
    "video",
    "by",
    "detailing",
    "following",
    "aspects",
    ":",
    "1",
    "2",
    "3",
    "4",
    "5",
    "main",
    "content",
    "and",
    "theme",
    "of",
    ",",
    "color",
    "shape",
    "size",
    "texture",
    "quantity",
    "text",
    "spatial",
    "relationships",
    "objects",
    "Actions",
    "events",
    "behaviors",
    "temporal",
    "physical",
    "movement",
    "changes",
    "background",
    "environment",
    "light",
    "style",
    "atmosphere",
    "camera",
    "angles",
    "movements",
    "transitions",
    "used",
    "in",
    "cat",
    "walks",
    "on",
    "grass",
    "sign",
    "reading",
]


def qwen_tokenizer(folder: Path):
    """A word-level tokenizer with Qwen2's chat markers and template, saved where ``AutoTokenizer`` reads it."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", *dict.fromkeys(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(
        [
            AddedToken(s, special=True, normalized=False)
            for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "\n")
        ]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>", padding_side="right"
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def text_encoders(root: Path) -> dict:
    """The tiny Qwen2.5-VL text decoder (width 24) and ByT5 encoder (width 20) with their tokenizers."""
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    def perturbed(model, seed):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        return model.eval()

    torch.manual_seed(2)
    lm_config = Qwen2_5_VLTextConfig(
        vocab_size=128,
        hidden_size=tiny.CONFIG["text_embed_dim"],
        intermediate_size=40,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 1], "rope_theta": 1e6},
    )
    lm_config._attn_implementation = "eager"
    torch.manual_seed(3)
    t5_config = T5Config(
        vocab_size=384,
        d_model=tiny.CONFIG["text_embed_2_dim"],
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    )
    return dict(
        text_encoder=perturbed(Qwen2_5_VLTextModel(lm_config), 2),
        tokenizer=qwen_tokenizer(root / "parts" / "tokenizer"),
        text_encoder_2=perturbed(T5EncoderModel(t5_config), 3),
        tokenizer_2=ByT5Tokenizer(),
    )
