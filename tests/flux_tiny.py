"""Tiny random diffusers FLUX transformers and their reference outputs, shared by the FLUX tests.

Built once per test session (cached): 8 heads of 16 dims (so heads split 8 ways), 2 double and 2
single blocks, RoPE axes (4, 6, 6), every weight perturbed away from its initial value (norm scales
are not all ones). Inputs have a text length (7) and a non-square image (3 x 5 = 15 tokens) that no
parallel degree divides.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import torch
from diffusers import FluxTransformer2DModel

from jaxdit.models.flux import FluxConfig

HEADS, HEAD_DIM, AXES = 8, 16, (4, 6, 6)
IN_CHANNELS, TEXT_DIM, POOLED_DIM = 16, 32, 32
TEXT_LEN, GRID = 7, (3, 5)


@functools.cache
def model(guidance: bool) -> FluxTransformer2DModel:
    torch.manual_seed(1 if guidance else 2)
    m = FluxTransformer2DModel(
        patch_size=1,
        in_channels=IN_CHANNELS,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=POOLED_DIM,
        guidance_embeds=guidance,
        axes_dims_rope=AXES,
    ).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def config(guidance: bool) -> FluxConfig:
    return FluxConfig.from_diffusers(dict(model(guidance).config))


def state_dict(guidance: bool) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model(guidance).state_dict().items()}


@functools.cache
def _root() -> Path:
    return Path(tempfile.mkdtemp(prefix="jaxdit-flux-tiny-"))


@functools.cache
def diffusers_folder(guidance: bool) -> Path:
    """``save_pretrained`` of the tiny model (one safetensors file + config.json)."""
    path = _root() / f"diffusers-{'dev' if guidance else 'schnell'}"
    model(guidance).save_pretrained(path)
    return path


def image_ids(h: int, w: int) -> np.ndarray:
    ids = np.zeros((h * w, 3), np.float32)
    ids[:, 1] = np.repeat(np.arange(h), w)
    ids[:, 2] = np.tile(np.arange(w), h)
    return ids


def inputs(guidance: bool, batch: int = 2, text_len: int = TEXT_LEN, grid=GRID, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    n = grid[0] * grid[1]
    x = {
        "hidden_states": rng.standard_normal((batch, n, IN_CHANNELS)).astype(np.float32),
        "encoder_hidden_states": rng.standard_normal((batch, text_len, TEXT_DIM)).astype(np.float32),
        "pooled_projections": rng.standard_normal((batch, POOLED_DIM)).astype(np.float32),
        "timestep": rng.uniform(0.05, 1.0, batch).astype(np.float32),
        "img_ids": image_ids(*grid),
        # Real text ids are zeros; random small ones also exercise the first RoPE axis.
        "txt_ids": rng.integers(0, 4, (text_len, 3)).astype(np.float32),
        "guidance": rng.uniform(1.0, 5.0, batch).astype(np.float32) if guidance else None,
    }
    return x


def reference(guidance: bool, x: dict) -> np.ndarray:
    """diffusers' output for inputs ``x`` (fp32, CPU)."""
    t = {k: None if v is None else torch.from_numpy(np.asarray(v)) for k, v in x.items()}
    with torch.no_grad():
        return model(guidance)(**t).sample.numpy()


@functools.cache
def case(guidance: bool, batch: int = 2) -> tuple[dict, np.ndarray]:
    """Default inputs and diffusers' output for them."""
    x = inputs(guidance, batch)
    return x, reference(guidance, x)
