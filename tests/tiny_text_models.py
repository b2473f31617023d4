"""Tiny random transformers text/image encoders and tokenizers, written as folders ``from_pretrained`` loads.

Everything is built locally (no network): the tokenizers from a small hand-made vocabulary with the
``tokenizers`` library through transformers' own ``T5Tokenizer`` / ``CLIPTokenizer`` classes, the models
from tiny configs with every weight perturbed away from its initial value (norm scales not all ones,
biases not zero). Widths default to those of the tiny transformers in ``flux_tiny.py`` (T5 32, CLIP
pooled 32) and ``wan_tiny.py`` (umT5 16, CLIP vision 24 with 5 image tokens), so a tiny diffusers
pipeline folder can be put together from these pieces:

    FLUX: text_encoder/ = save_tiny_clip_text, tokenizer/ = save_tiny_clip_tokenizer,
          text_encoder_2/ = save_tiny_t5, tokenizer_2/ = save_tiny_t5_tokenizer
    Wan:  text_encoder/ = save_tiny_umt5, tokenizer/ = save_tiny_t5_tokenizer,
          image_encoder/ = save_tiny_clip_vision, image_processor/ = save_tiny_clip_image_processor

Each ``save_*`` returns the folder it wrote.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

PathLike = str | os.PathLike[str]

#: Words the tiny tokenizers know whole; anything else falls back to characters (T5) or bytes (CLIP).
WORDS = [
    "a",
    "photo",
    "of",
    "the",
    "cat",
    "dog",
    "on",
    "mat",
    "red",
    "blue",
    "green",
    "sky",
    "tree",
    "house",
    "car",
    "fast",
    "slow",
    "big",
    "small",
    "with",
    "and",
    "in",
    "is",
    "at",
    "sunset",
    "night",
    "day",
    "river",
    "mountain",
    "city",
    "street",
    "painting",
]
#: CLIP's context length.
CLIP_MAX_LENGTH = 77

T5_DEFAULTS = dict(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4)
UMT5_DEFAULTS = dict(d_model=16, d_kv=4, d_ff=40, num_layers=3, num_heads=4)
CLIP_TEXT_DEFAULTS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
#: 28 px images in 14 px patches: 4 patches + the class token = 5 tokens (wan_tiny.IMAGE_TOKENS).
CLIP_VISION_DEFAULTS = dict(
    hidden_size=24,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=28,
    patch_size=14,
    hidden_act="gelu",  # ViT-H/14 (Wan I2V) uses the erf GELU
)


def _perturb(model: torch.nn.Module, seed: int, scale: float = 0.1) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


# --------------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------------


def t5_tokenizer() -> Any:
    """A tiny Unigram T5 tokenizer: <pad> 0, </s> 1, <unk> 2, whole words, then single characters."""
    from transformers import T5Tokenizer

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -3.0) for w in WORDS]
    vocab += [("\u2581" + c, -6.0) for c in chars]
    vocab += [(c, -7.0) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def save_tiny_t5_tokenizer(folder: PathLike) -> Path:
    """The tiny T5 tokenizer (also used as the umT5 one) as a folder ``AutoTokenizer`` loads."""
    t5_tokenizer().save_pretrained(str(folder))
    return Path(folder)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def clip_tokenizer() -> Any:
    """A tiny byte-level BPE CLIP tokenizer: every byte alone and word-final, the WORDS merged whole;
    ``<|startoftext|>`` and ``<|endoftext|>`` get the two highest ids, as in OpenAI's vocabulary."""
    from transformers import CLIPTokenizer

    symbols = list(_bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols]
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            merged = parts[0] + parts[1]
            if (parts[0], parts[1]) not in merges:
                merges.append((parts[0], parts[1]))
            if merged not in tokens:
                tokens.append(merged)
            parts = [merged] + parts[2:]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)


def save_tiny_clip_tokenizer(folder: PathLike) -> Path:
    """The tiny CLIP tokenizer as a folder ``AutoTokenizer`` loads (pads with <|endoftext|>, 77 tokens)."""
    clip_tokenizer().save_pretrained(str(folder))
    return Path(folder)


def save_tiny_clip_image_processor(folder: PathLike, image_size: int = 28) -> Path:
    """A ``CLIPImageProcessor`` (OpenAI mean/std, resize shortest edge + centre crop) for ``image_size``."""
    from transformers import CLIPImageProcessor

    CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    ).save_pretrained(str(folder))
    return Path(folder)


# --------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------


def tiny_t5(seed: int = 0, **overrides: Any) -> Any:
    """A tiny random ``T5EncoderModel`` (T5 v1.1: gated-gelu), vocabulary of the tiny T5 tokenizer."""
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=len(t5_tokenizer()),
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        **{**T5_DEFAULTS, **overrides},
    )
    torch.manual_seed(seed)
    return _perturb(T5EncoderModel(cfg), seed)


def tiny_umt5(seed: int = 1, **overrides: Any) -> Any:
    """A tiny random ``UMT5EncoderModel`` (a relative position bias in every layer)."""
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = UMT5Config(
        vocab_size=len(t5_tokenizer()),
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=128,  # fixed in Wan's T5 (not in its state dict)
        **{**UMT5_DEFAULTS, **overrides},
    )
    torch.manual_seed(seed)
    return _perturb(UMT5EncoderModel(cfg), seed)


def tiny_clip_text(seed: int = 2, *, legacy_eos: bool = True, **overrides: Any) -> Any:
    """A tiny random ``CLIPTextModel``. ``legacy_eos``: the config's eos_token_id is 2, as in FLUX's (the
    pooled token is then found by argmax of the ids); otherwise the tokenizer's real <|endoftext|> id
    (``eos_token_id=`` in ``overrides`` sets any other)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    tok = clip_tokenizer()
    fields = dict(
        vocab_size=len(tok),
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act="quick_gelu",
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
        eos_token_id=2 if legacy_eos else tok.eos_token_id,
        **CLIP_TEXT_DEFAULTS,
    )
    torch.manual_seed(seed)
    return _perturb(CLIPTextModel(CLIPTextConfig(**{**fields, **overrides})), seed)


def tiny_clip_vision(seed: int = 3, **overrides: Any) -> Any:
    """A tiny random ``CLIPVisionModel`` (28 px, 14 px patches: 5 tokens; erf GELU like ViT-H/14)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    cfg = CLIPVisionConfig(**{**CLIP_VISION_DEFAULTS, **overrides})
    torch.manual_seed(seed)
    return _perturb(CLIPVisionModel(cfg), seed)


def _save(model: Any, folder: PathLike) -> Path:
    model.save_pretrained(str(folder))
    return Path(folder)


def save_tiny_t5(folder: PathLike, seed: int = 0, **overrides: Any) -> Path:
    return _save(tiny_t5(seed, **overrides), folder)


def save_tiny_umt5(folder: PathLike, seed: int = 1, **overrides: Any) -> Path:
    return _save(tiny_umt5(seed, **overrides), folder)


def save_tiny_clip_text(
    folder: PathLike, seed: int = 2, *, legacy_eos: bool = True, **overrides: Any
) -> Path:
    return _save(tiny_clip_text(seed, legacy_eos=legacy_eos, **overrides), folder)


def save_tiny_clip_vision(folder: PathLike, seed: int = 3, **overrides: Any) -> Path:
    return _save(tiny_clip_vision(seed, **overrides), folder)


def save_tiny_flux_text(folder: PathLike) -> Path:
    """The four text folders of a FLUX pipeline (text_encoder, tokenizer, text_encoder_2, tokenizer_2)."""
    folder = Path(folder)
    save_tiny_clip_text(folder / "text_encoder")
    save_tiny_clip_tokenizer(folder / "tokenizer")
    save_tiny_t5(folder / "text_encoder_2")
    save_tiny_t5_tokenizer(folder / "tokenizer_2")
    return folder


def save_tiny_wan_text(folder: PathLike, *, i2v: bool = False) -> Path:
    """A Wan pipeline's text folders (text_encoder, tokenizer), and for I2V image_encoder, image_processor."""
    folder = Path(folder)
    save_tiny_umt5(folder / "text_encoder")
    save_tiny_t5_tokenizer(folder / "tokenizer")
    if i2v:
        save_tiny_clip_vision(folder / "image_encoder")
        save_tiny_clip_image_processor(folder / "image_processor")
    return folder
