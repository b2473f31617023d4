"""FLUX.1's text encoders from a diffusers FluxPipeline folder (CLIP + T5); its VAE is the shared
AutoencoderKL (``jaxdit.loading.vae``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from jaxdit.loading.encoders import load_clip_text, load_t5, load_tokenizer
from jaxdit.text_encoders.common import resolve_device
from jaxdit.text_encoders.encoders import FluxTextEncoders

__all__ = ["load_flux_text_encoders"]

PathLike = str | os.PathLike[str]


def load_flux_text_encoders(
    folder: PathLike,
    dtype: Any = None,
    device: jax.Device | None = None,
    *,
    compiler_options: Mapping[str, Any] | None = None,
    offload: bool = False,
) -> FluxTextEncoders:
    """From a diffusers FluxPipeline folder: ``text_encoder/`` + ``tokenizer/`` (CLIP), ``text_encoder_2/``
    + ``tokenizer_2/`` (T5). ``dtype`` defaults to the checkpoints' (float16 -> float32); ``device`` to
    ``jax.local_devices()[0]``; ``offload``: their weights wait in host memory between prompts."""
    folder = Path(folder)
    device = resolve_device(device)
    return FluxTextEncoders(
        load_clip_text(folder / "text_encoder", device=device, dtype=dtype),
        load_t5(folder / "text_encoder_2", device=device, dtype=dtype),
        load_tokenizer(folder / "tokenizer"),
        load_tokenizer(folder / "tokenizer_2"),
        compiler_options=compiler_options,
        offload=offload,
    )
