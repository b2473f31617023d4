"""HunyuanVideo 1.5's VAE from a checkpoint (``converters/vae_hunyuan_video15.py``, filled through
:func:`jaxdit.loading.vae.filled`), its two text encoders and (image-to-video) its SigLIP image encoder
from a pipeline folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from converters import vae_hunyuan_video15
from converters.siglip import open_siglip_vision
from jaxdit.loading.decoder_lm import load_decoder_lm
from jaxdit.loading.encoders import load_module, load_t5, load_tokenizer
from jaxdit.loading.vae import filled
from jaxdit.text_encoders import siglip
from jaxdit.text_encoders.common import default_dtype, parameter_shapes, resolve_device
from jaxdit.text_encoders.decoder_lm import DecoderLMRunner
from jaxdit.text_encoders.hunyuan_video15_prompt import HunyuanVideo15PromptEncoder
from jaxdit.vae.hunyuan_video15_vae import HunyuanVideo15VAE, abstract_vae

__all__ = [
    "load_hunyuan_video15_image_encoder",
    "load_hunyuan_video15_prompt_encoder",
    "load_hunyuan_video15_vae",
]


def load_hunyuan_video15_vae(path: str | os.PathLike[str], dtype: Any = jnp.float32) -> HunyuanVideo15VAE:
    """A diffusers ``AutoencoderKLHunyuanVideo15`` folder (or the pipeline folder holding ``vae/``)."""
    ckpt = vae_hunyuan_video15.detect(path)
    dtype = jnp.dtype(dtype)
    return filled(abstract_vae(ckpt.config, dtype), ckpt.resolve, dtype)


def load_hunyuan_video15_prompt_encoder(
    folder: str | os.PathLike[str], *, device: Any = None, dtype: Any = None
) -> HunyuanVideo15PromptEncoder:
    """The two text encoders of a ``HunyuanVideo15Pipeline`` folder (``text_encoder/`` + ``tokenizer/``:
    Qwen2.5-VL's text decoder; ``text_encoder_2/`` + ``tokenizer_2/``: ByT5) on ``device``."""
    folder = Path(folder)
    lm = load_decoder_lm(folder / "text_encoder", device=device, dtype=dtype)
    byt5 = load_t5(folder / "text_encoder_2", device=device, dtype=dtype)
    return HunyuanVideo15PromptEncoder(
        load_tokenizer(folder / "tokenizer"),
        DecoderLMRunner(lm),
        load_tokenizer(folder / "tokenizer_2"),
        byt5,
    )


def load_hunyuan_video15_image_encoder(
    path: str | os.PathLike[str], *, device: Any = None, dtype: Any = None
) -> siglip.SiglipVisionModel:
    """A transformers ``SiglipVisionModel`` folder (an I2V folder's ``image_encoder/``) on ``device``."""
    opened = open_siglip_vision(path)
    dtype = dtype if dtype is not None else default_dtype(opened.dtype)
    model = siglip.abstract_vision_model(opened.config, dtype)
    return load_module(model, opened.resolve(parameter_shapes(model)), resolve_device(device), dtype)
