"""Tiny random diffusers Wan transformers and their reference outputs, shared by the Wan tests.

Built once per test session (cached). 8 heads of 12 dims (heads split 8 ways; RoPE split 4/4/4), 2
blocks, every weight perturbed away from its initial value (norm scales are not all ones, zero-initialised
biases are not zero). T2V: 4 latent channels, 7 text tokens. I2V: 8 input channels (noise + condition,
as the real 36), ``added_kv_proj_dim = heads * head_dim`` and an image width so that the real image path
runs (separate image K/V, two softmaxes); diffusers splits image from text at L - 512, so the text is
exactly 512 tokens there. Latent shapes give token counts (45 = 3 x 3 x 5, 30 = 5 x 2 x 3, 8 = 1 x 2 x 4)
that the parallel degrees mostly do not divide.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import torch
from diffusers import WanTransformer3DModel

from converters.wan import write_original
from jaxdit.models.wan import WanConfig

HEADS, HEAD_DIM, FFN, LAYERS = 8, 12, 40, 2
TEXT_DIM, IMAGE_DIM, IMAGE_TOKENS = 16, 24, 5
OUT_CHANNELS = 4
#: Latent [frames, height, width] per case; tokens = frames * (height / 2) * (width / 2).
SHAPES = {"f3_6x10": (3, 6, 10), "f5_4x6": (5, 4, 6), "f1_4x8": (1, 4, 8)}
DEFAULT_SHAPE = "f3_6x10"


def in_channels(i2v: bool) -> int:
    return 8 if i2v else 4


def text_len(i2v: bool) -> int:
    return 512 if i2v else 7


@functools.cache
def model(i2v: bool) -> WanTransformer3DModel:
    torch.manual_seed(11 if i2v else 12)
    extra = dict(image_dim=IMAGE_DIM, added_kv_proj_dim=HEADS * HEAD_DIM) if i2v else {}
    m = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=in_channels(i2v),
        out_channels=OUT_CHANNELS,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=FFN,
        num_layers=LAYERS,
        rope_max_seq_len=64,
        **extra,
    ).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def config(i2v: bool) -> WanConfig:
    return WanConfig.from_diffusers(dict(model(i2v).config))


def state_dict(i2v: bool) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model(i2v).state_dict().items()}


@functools.cache
def _root() -> Path:
    return Path(tempfile.mkdtemp(prefix="jaxdit-wan-tiny-"))


def _name(i2v: bool) -> str:
    return "i2v" if i2v else "t2v"


@functools.cache
def diffusers_folder(i2v: bool) -> Path:
    """``save_pretrained`` of the tiny model (one safetensors file + config.json)."""
    path = _root() / f"diffusers-{_name(i2v)}"
    model(i2v).save_pretrained(path)
    return path


@functools.cache
def original_folder(i2v: bool) -> Path:
    """The same weights in the original layout: 3 shard files, an index and the original config.json."""
    return write_original(config(i2v), state_dict(i2v), _root() / f"original-{_name(i2v)}", shards=3)


def inputs(i2v: bool, shape: str = DEFAULT_SHAPE, batch: int = 2, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    f, h, w = SHAPES[shape]
    return {
        "hidden_states": rng.standard_normal((batch, in_channels(i2v), f, h, w)).astype(np.float32),
        # Integer timesteps in [0, 1000), as UniPC gives them.
        "timestep": rng.integers(0, 1000, batch).astype(np.int64),
        "encoder_hidden_states": rng.standard_normal((batch, text_len(i2v), TEXT_DIM)).astype(np.float32),
        "encoder_hidden_states_image": (
            rng.standard_normal((batch, IMAGE_TOKENS, IMAGE_DIM)).astype(np.float32) if i2v else None
        ),
    }


def reference(i2v: bool, x: dict) -> np.ndarray:
    """diffusers' output for inputs ``x`` (fp32, CPU)."""
    t = {k: None if v is None else torch.from_numpy(np.asarray(v)) for k, v in x.items()}
    with torch.no_grad():
        return model(i2v)(**t).sample.numpy()


@functools.cache
def case(i2v: bool, shape: str = DEFAULT_SHAPE, batch: int = 2) -> tuple[dict, np.ndarray]:
    """Inputs and diffusers' output for them."""
    x = inputs(i2v, shape, batch)
    return x, reference(i2v, x)
