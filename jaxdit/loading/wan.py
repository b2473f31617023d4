"""Wan 2.1 / 2.2's text encoder (umT5), image encoder (CLIP vision, I2V) and causal 3-D VAE, from a
diffusers Wan pipeline folder or Wan's original release."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from converters import vae_wan
from converters.errors import CheckpointError
from converters.t5 import WAN_T5_FILE
from jaxdit.loading.encoders import load_clip_vision, load_t5, load_tokenizer
from jaxdit.loading.vae import filled
from jaxdit.text_encoders.encoders import WanImageEncoder, WanTextEncoder
from jaxdit.vae import wan_vae
from jaxdit.vae.wan_vae import WanVAE, WanVAEConfig

__all__ = ["WAN_TOKENIZER_DIR", "load_wan_image_encoder", "load_wan_text_encoder", "load_wan_vae"]

PathLike = str | os.PathLike[str]
#: Wan's original release keeps the umT5 tokenizer here.
WAN_TOKENIZER_DIR = Path("google") / "umt5-xxl"


def _wan_text_paths(folder: Path) -> tuple[Path, Path]:
    """(encoder checkpoint, tokenizer folder) of a diffusers WanPipeline folder or Wan's original one."""
    if (folder / "text_encoder").is_dir():
        return folder / "text_encoder", folder / "tokenizer"
    if (folder / WAN_T5_FILE).is_file():
        return folder / WAN_T5_FILE, folder / WAN_TOKENIZER_DIR
    raise CheckpointError(
        f"{folder}: neither a diffusers WanPipeline folder (text_encoder/, tokenizer/) nor Wan's original "
        f"folder ({WAN_T5_FILE}, {WAN_TOKENIZER_DIR}/)"
    )


def load_wan_text_encoder(
    folder: PathLike,
    dtype: Any = None,
    device: jax.Device | None = None,
    *,
    compiler_options: Mapping[str, Any] | None = None,
    offload: bool = False,
) -> WanTextEncoder:
    """From a diffusers WanPipeline folder (``text_encoder/``, ``tokenizer/``) or Wan's original folder
    (``models_t5_umt5-xxl-enc-bf16.pth``, ``google/umt5-xxl/``)."""
    checkpoint, tokenizer = _wan_text_paths(Path(folder))
    return WanTextEncoder(
        load_t5(checkpoint, device=device, dtype=dtype),
        load_tokenizer(tokenizer),
        compiler_options=compiler_options,
        offload=offload,
    )


def load_wan_image_encoder(
    folder: PathLike,
    dtype: Any = None,
    device: jax.Device | None = None,
    *,
    compiler_options: Mapping[str, Any] | None = None,
    offload: bool = False,
) -> WanImageEncoder:
    """From a diffusers WanImageToVideoPipeline folder: ``image_encoder/`` + ``image_processor/``."""
    folder = Path(folder)
    if not (folder / "image_processor").is_dir():
        raise CheckpointError(f"{folder}: no image_processor/ folder (a diffusers Wan I2V pipeline has one)")
    from transformers import CLIPImageProcessor  # deferred: importing transformers takes seconds

    processor = CLIPImageProcessor.from_pretrained(str(folder / "image_processor"))
    return WanImageEncoder(
        load_clip_vision(folder / "image_encoder", device=device, dtype=dtype),
        processor,
        compiler_options=compiler_options,
        offload=offload,
    )


def load_wan_vae(
    path: str | os.PathLike[str],
    dtype: Any = None,
    *,
    config: WanVAEConfig | Mapping[str, Any] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> WanVAE:
    """A diffusers ``vae/`` folder (or a pipeline folder holding one), Wan's ``Wan2.1_VAE.pth`` or
    ``Wan2.2_VAE.pth`` (or a folder holding it), or a single ``.safetensors`` of either key layout.

    ``dtype`` defaults to the checkpoint's storage dtype; ``config`` overrides the one read or inferred (a
    ``.pth`` has none: the Wan 2.1 or 2.2 preset, by its keys, with widths read from the tensors).
    """
    ckpt = vae_wan.detect(path, config)
    dtype = jnp.dtype(dtype or ckpt.dtype)
    model = filled(wan_vae.abstract_model(ckpt.config, dtype), ckpt.resolve, dtype)
    return WanVAE(model, compiler_options=compiler_options)
