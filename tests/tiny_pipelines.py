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


# --------------------------------------------------------------------------------------------------------
# Wan 2.2: A14B (two experts; T2V and I2V without CLIP) and TI2V-5B (the Wan 2.2 VAE, expand_timesteps)
# --------------------------------------------------------------------------------------------------------

#: The A14B releases' boundaries (Wan2.2 wan/configs/wan_{t2v,i2v}_A14B.py; diffusers' model_index.json).
WAN22_BOUNDARY = {"t2v": 0.875, "i2v": 0.9}
#: The tiny TI2V model's latent width: the Wan 2.2 VAE's real 48, so that an original-layout .pth (which
#: carries no config: the preset's 48 latent statistics apply) and the diffusers folder agree.
TI2V_Z = 48


def _wan_transformer(in_channels: int, out_channels: int, text_dim: int, seed: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=text_dim,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    return _perturb(transformer, seed)


def _wan21_vae():
    from diffusers import AutoencoderKLWan

    # The released depths (dim_mult, two residual blocks a level): an original-layout .pth carries no
    # config, and is read as the release's with the widths taken from its tensors.
    vae = AutoencoderKLWan(base_dim=4, z_dim=16, num_res_blocks=2, temperal_downsample=[False, True, True])
    return _perturb(vae, 42, 0.05)


def _wan22_vae():
    """A tiny Wan 2.2 VAE shaped like the released one (residual, 2x2 patchify, 4 x 16 x 16, 48 channels
    with the released latent statistics); RMS_norm gammas and biases perturbed."""
    from diffusers import AutoencoderKLWan

    from jaxdit.vae.wan_vae import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD

    torch.manual_seed(45)
    vae = AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=6,
        z_dim=TI2V_Z,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=list(WAN22_LATENTS_MEAN),
        latents_std=list(WAN22_LATENTS_STD),
    ).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith(("gamma", "bias")):
                p.add_(0.1 * torch.randn_like(p))
    return vae


@functools.cache
def wan22(variant: str):
    """(folder, the diffusers pipeline saved there, the components) of a tiny Wan 2.2 pipeline.

    ``t2v``: ``WanPipeline`` with two experts (boundary 0.875); ``i2v``: ``WanImageToVideoPipeline`` with
    two 36-channel experts, no image encoder (boundary 0.9); ``ti2v``: ``WanPipeline`` with
    ``expand_timesteps`` and the Wan 2.2 VAE (its image-to-video reference is a
    ``WanImageToVideoPipeline`` of the same components, as diffusers users build it).
    """
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline
    from transformers import UMT5EncoderModel

    root = Path(tempfile.mkdtemp(prefix=f"jaxdit-tiny-wan22-{variant}-"))
    text = _text_components(
        root / "staging", lambda f: text_models.save_tiny_wan_text(f), {"text_encoder": UMT5EncoderModel}
    )
    text_dim = text["text_encoder"].config.d_model
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    if variant == "ti2v":
        components = dict(
            scheduler=scheduler,
            vae=_wan22_vae(),
            transformer=_wan_transformer(TI2V_Z, TI2V_Z, text_dim, 51),
            **text,
        )
        pipe = WanPipeline(**components, expand_timesteps=True)
    else:
        channels = 36 if variant == "i2v" else 16
        components = dict(
            scheduler=scheduler,
            vae=_wan21_vae(),
            transformer=_wan_transformer(channels, 16, text_dim, 52 if variant == "i2v" else 53),
            transformer_2=_wan_transformer(channels, 16, text_dim, 54 if variant == "i2v" else 55),
            **text,
        )
        cls = WanImageToVideoPipeline if variant == "i2v" else WanPipeline
        pipe = cls(**components, boundary_ratio=WAN22_BOUNDARY[variant])
    folder = root / f"Wan2.2-{variant.upper()}-tiny-Diffusers"
    pipe.save_pretrained(folder)
    return folder, pipe, components


def wan22_image_pipeline(variant: str):
    """The diffusers image-to-video pipeline of a tiny Wan 2.2 variant (TI2V: built from its components)."""
    from diffusers import WanImageToVideoPipeline

    _, pipe, components = wan22(variant)
    if variant != "ti2v":
        return pipe
    return WanImageToVideoPipeline(**components, expand_timesteps=True)


@functools.cache
def wan22_original(variant: str) -> Path:
    """The same tiny Wan 2.2 weights as Wan-AI's original release lays them out: A14B with
    ``high_noise_model/`` and ``low_noise_model/`` (sharded safetensors + the original config.json) and
    ``Wan2.1_VAE.pth``; TI2V-5B with the transformer at the root and ``Wan2.2_VAE.pth``; both with the
    umT5 ``.pth`` and ``google/umt5-xxl/``."""
    import shutil

    import numpy as np

    from converters import vae_wan
    from converters.t5 import WAN_T5_FILE, hf_to_params, write_wan_original
    from converters.wan import write_original
    from jaxdit.models.wan import WanConfig
    from jaxdit.text_encoders.t5 import T5Config
    from jaxdit.vae.wan_vae import WanVAEConfig

    folder, _, components = wan22(variant)
    root = folder.parent / f"Wan2.2-{variant.upper()}-tiny"
    numpy = lambda m: {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}
    experts = (
        [("transformer", root)]
        if variant == "ti2v"
        else [
            ("transformer", root / "high_noise_model"),
            ("transformer_2", root / "low_noise_model"),
        ]
    )
    for name, target in experts:
        model = components[name]
        config = WanConfig.from_diffusers(dict(model.config))
        write_original(
            config, numpy(model), target, shards=2, model_type="ti2v" if variant == "ti2v" else None
        )
    vae = components["vae"]
    vae_config = WanVAEConfig.from_diffusers(dict(vae.config))
    vae_file = "Wan2.2_VAE.pth" if variant == "ti2v" else "Wan2.1_VAE.pth"
    vae_wan.write_original_pth(
        vae_config, vae_wan.diffusers_to_params(vae_config, numpy(vae)), root / vae_file
    )
    encoder = components["text_encoder"]
    t5 = T5Config.from_hf_config(encoder.config.to_dict())
    t5_sd = write_wan_original(t5, hf_to_params(t5, numpy(encoder)))
    torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in t5_sd.items()}, root / WAN_T5_FILE)
    shutil.copytree(folder / "tokenizer", root / "google" / "umt5-xxl")
    return root
