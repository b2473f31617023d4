"""Tiny random transformers decoder LMs saved as text-encoder folders (sharded safetensors + index).

The layouts the decoder-LM encoder reads, one per family it covers:

- Qwen2.5-VL: ``Qwen2_5_VLForConditionalGeneration`` with a one-block vision tower (Qwen-Image's
  ``text_encoder/``), so loading must recognise and skip the vision tensors and the LM head;
- Qwen2: ``Qwen2ForCausalLM`` (q/k/v biases, no vision tower);
- Qwen3: ``Qwen3ForCausalLM`` (FLUX.2 klein), head width set apart from hidden / heads, q/k norms;
- Mistral: a bare ``MistralModel`` (keys without a prefix), one key/value head, llama3 RoPE scaling.

Every weight is perturbed away from its initial value (norm scales not all ones, biases not zero), and
the files are cut into several shards so the index is exercised.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

PathLike = str | os.PathLike[str]

#: Small enough for a second per forward, large enough for grouped heads and several layers.
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4)


def _perturb(model: torch.nn.Module, seed: int, scale: float = 0.1) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


def qwen2_5_vl(seed: int = 0, **text: Any) -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text_config = dict(
        TEXT,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e6},
    )
    text_config.update(text)
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2
    )
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return _perturb(Qwen2_5_VLForConditionalGeneration(config), seed)


def qwen2(seed: int = 3, **text: Any) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**TEXT, "num_key_value_heads": 2, "rope_theta": 1e6, **text})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return _perturb(Qwen2ForCausalLM(config), seed)


def qwen3(seed: int = 1, **text: Any) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**TEXT, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1e4, **text})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return _perturb(Qwen3ForCausalLM(config), seed)


def mistral(seed: int = 2, **text: Any) -> torch.nn.Module:
    from transformers import MistralConfig, MistralModel

    rope = {
        "rope_type": "llama3",
        "rope_theta": 1e4,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    config = MistralConfig(**{**TEXT, "num_key_value_heads": 1, "rope_parameters": rope, **text})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return _perturb(MistralModel(config), seed)


BUILDERS = {"qwen2_5_vl": qwen2_5_vl, "qwen2": qwen2, "qwen3": qwen3, "mistral": mistral}


def save(model: torch.nn.Module, folder: PathLike, shard: str = "24KB") -> Path:
    """``save_pretrained`` in several safetensors shards with an index."""
    folder = Path(folder)
    model.save_pretrained(folder, max_shard_size=shard)
    return folder


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder inside a saved class (what produces the hidden states)."""
    return getattr(model, "model", model)


#: The tiny Qwen tokenizer's words: Qwen-Image's template and a few for prompts.
TEMPLATE_WORDS = [
    "system",
    "Describe",
    "the",
    "image",
    "by",
    "detailing",
    "color",
    ",",
    "shape",
    "size",
    "texture",
    "quantity",
    "text",
    "spatial",
    "relationships",
    "of",
    "objects",
    "and",
    "background",
    ":",
    "user",
    "assistant",
]
PROMPT_WORDS = [
    "a",
    "photo",
    "cat",
    "dog",
    "on",
    "mat",
    "red",
    "blue",
    "car",
    "at",
    "sunset",
    "big",
    "small",
    "with",
    "tree",
    "house",
    "sky",
]
#: Chat markers and the newline are special (added) tokens, so the template's system prefix is exactly
#: the 34 tokens Qwen's own tokenizer gives it.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "\n"]


def save_qwen_tokenizer(folder: PathLike) -> Path:
    """A word-level tokenizer with Qwen2's chat markers, saved where ``AutoTokenizer`` reads it."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", *dict.fromkeys(TEMPLATE_WORDS + PROMPT_WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>", padding_side="right"
    )
    assert len(hf) <= TEXT["vocab_size"], len(hf)
    hf.save_pretrained(folder)
    return Path(folder)
