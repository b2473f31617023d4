"""A tiny ``Flux2KleinPipeline`` folder saved by diffusers: random weights, an offline tokenizer.

Qwen3 text encoder of 28 layers and width 32 (so diffusers' default layers 9, 18 and 27 are all
intermediate outputs, as in the released 36-layer encoders), the tiny FLUX.2 transformer of
``flux2_tiny.CONFIG`` without a guidance embedding reading the 3 x 32 stacked features, a 2-level
AutoencoderKLFlux2 (factor 2, 4 latent channels: 16 after the 2 x 2 patches) with random BatchNorm
statistics, and FLUX.2's scheduler config (exponential dynamic shift).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

ENCODER_LAYERS, ENCODER_WIDTH = 28, 32


def vae():
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(61)
    model = AutoencoderKLFlux2(
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
    ).eval()
    gen = torch.Generator().manual_seed(62)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
        model.bn.running_mean.copy_(0.3 * torch.randn(16, generator=gen))
        model.bn.running_var.copy_(torch.rand(16, generator=gen) + 0.5)
    return model


def pipeline(folder, *, distilled: bool = True):
    """Save the tiny klein folder at ``folder``; returns the path."""
    import decoder_lm_tiny
    import flux2_tiny
    import z_image_tiny
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import AutoTokenizer

    staging = Path(tempfile.mkdtemp(prefix="jaxdit-flux2-staging-"))
    z_image_tiny.save_tokenizer(staging / "tokenizer")
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential"
        ),
        vae=vae(),
        text_encoder=decoder_lm_tiny.qwen3(num_hidden_layers=ENCODER_LAYERS),
        tokenizer=AutoTokenizer.from_pretrained(staging / "tokenizer"),
        transformer=flux2_tiny.transformer(
            seed=63, guidance_embeds=False, joint_attention_dim=3 * ENCODER_WIDTH
        ),
        is_distilled=distilled,
    )
    pipe.save_pretrained(folder)
    shutil.rmtree(staging, ignore_errors=True)
    return Path(folder)


def base_copy(folder, to) -> Path:
    """The same weights as a klein base folder (``is_distilled: false``)."""
    shutil.copytree(folder, to)
    index = json.loads((Path(to) / "model_index.json").read_text())
    index["is_distilled"] = False
    (Path(to) / "model_index.json").write_text(json.dumps(index))
    return Path(to)
