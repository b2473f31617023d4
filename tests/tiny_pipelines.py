"""Tiny random diffusers pipeline folders (FluxPipeline, WanPipeline), written as the hub lays them out.

Each folder is what ``save_pretrained`` writes: ``model_index.json`` plus one sub-folder per component.
The text encoders and tokenizers come from :mod:`tests.tiny_text_models` (built locally, no download);
the transformer and VAE are random diffusers models with every weight perturbed away from its initial
value (so zero-initialised layers are not zero and norm scales are not all ones). Built once per test
session (cached) into a temporary folder. The in-memory diffusers pipeline is kept beside the folder as the
reference (reloading it would need ``accelerate`` for Wan's fp32-kept modules).

FLUX: 2 heads of 16 (RoPE 4/4/8), one double and one single block, guidance embedding (dev); a 2-level
AutoencoderKL (factor 2, 4 latent channels, so 16 packed channels). Wan: 2 heads of 12, 2 blocks; the
4-level causal VAE (factor 8 in space, 4 in time) with 16 latent channels, as the real one.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import tiny_text_models as text_models
import torch


def _perturb(module: torch.nn.Module, seed: int, scale: float = 0.1) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return module.eval()


def _text_components(staging: Path, write, models: dict) -> dict:
    """Write the tiny text encoders/tokenizers (and image encoder) with ``write``, then load them with
    transformers (``models``: component -> model class) so the diffusers pipeline can be built and saved."""
    from transformers import AutoImageProcessor, AutoTokenizer

    write(staging)
    loaded = {name: cls.from_pretrained(staging / name) for name, cls in models.items()}
    for sub in sorted(p.name for p in staging.iterdir()):
        if sub.startswith("tokenizer"):
            loaded[sub] = AutoTokenizer.from_pretrained(staging / sub)
        elif sub == "image_processor":
            loaded[sub] = AutoImageProcessor.from_pretrained(staging / sub)
    return loaded


def flux_folder() -> Path:
    return flux()[0]


def wan_folder() -> Path:
    return wan()[0]


@functools.cache
def flux():
    """(folder, the diffusers FluxPipeline object it was saved from)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    root = Path(tempfile.mkdtemp(prefix="jaxdit-tiny-flux-"))
    staging = root / "staging"
    text = _text_components(
        staging,
        text_models.save_tiny_flux_text,
        {"text_encoder": CLIPTextModel, "text_encoder_2": T5EncoderModel},
    )
    torch.manual_seed(31)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text["text_encoder_2"].config.d_model,
        pooled_projection_dim=text["text_encoder"].config.hidden_size,
        guidance_embeds=True,
        axes_dims_rope=(4, 4, 8),
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15
    )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=_perturb(vae, 32, 0.05),
        transformer=_perturb(transformer, 33),
        **text,
    )
    folder = root / "FLUX.1-tiny"
    pipe.save_pretrained(folder)
    return folder, pipe


@functools.cache
def wan():
    """(folder, the diffusers WanPipeline object it was saved from)."""
    return _wan(i2v=False)


@functools.cache
def wan_i2v():
    """(folder, the diffusers WanImageToVideoPipeline object it was saved from). The transformer reads 36
    channels (noise + 4 mask + 16 condition latent) and has the real image path (image_dim, added K/V)."""
    return _wan(i2v=True)


def _wan(i2v: bool):
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import CLIPVisionModel, UMT5EncoderModel

    root = Path(tempfile.mkdtemp(prefix="jaxdit-tiny-wan-"))
    staging = root / "staging"
    models = {"text_encoder": UMT5EncoderModel}
    if i2v:
        models["image_encoder"] = CLIPVisionModel
    text = _text_components(staging, lambda f: text_models.save_tiny_wan_text(f, i2v=i2v), models)
    torch.manual_seed(41)
    heads, head_dim = 2, 12
    image = (
        dict(image_dim=text["image_encoder"].config.hidden_size, added_kv_proj_dim=heads * head_dim)
        if i2v
        else {}
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=36 if i2v else 16,
        out_channels=16,
        text_dim=text["text_encoder"].config.d_model,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        **image,
    )
    vae = AutoencoderKLWan(
        base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    cls = WanImageToVideoPipeline if i2v else WanPipeline
    pipe = cls(
        scheduler=scheduler,
        vae=_perturb(vae, 42, 0.05),
        transformer=_perturb(transformer, 44 if i2v else 43),
        **text,
    )
    folder = root / ("Wan2.1-I2V-tiny" if i2v else "Wan2.1-tiny")
    pipe.save_pretrained(folder)
    return folder, pipe
