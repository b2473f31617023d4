"""What a Wan generation request may be, checked from shapes alone (no devices, no weights).

``jaxdit generate`` runs :func:`check_inputs` before jax starts, and the pipeline again on its real
arrays. diffusers rounds bad sizes and frame counts with a warning (``pipelines/wan/pipeline_wan.py``);
here they are errors naming the nearest valid values, so that what runs is what was asked for.

The image conditions a Wan variant takes (``config`` says which, with the pipeline's
``expand_timesteps``):

- Wan 2.1 I2V: ``condition`` [B, 4 + 16, F', h, w] (mask + first-frame latent, read beside the noise)
  and ``image_embeds`` [B, 257, 1280] (CLIP features);
- Wan 2.2 I2V-A14B: ``condition`` only (it has no CLIP image path);
- Wan 2.2 TI2V-5B (``expand_timesteps``): optionally ``condition`` [B, C, 1, h, w], the normalised latent
  of the first frame, which replaces the first latent frame at every step (image-to-video); without it
  the model generates from text alone.
"""

from __future__ import annotations

import dataclasses
import math

from jaxdit.mesh import ParallelConfig
from jaxdit.models.sharded_forward import validate_forward
from jaxdit.models.wan_config import WanConfig

__all__ = ["WanInputs", "check_inputs", "default_flow_shift", "nearest"]

Shape = tuple[int, ...]


def default_flow_shift(height: int, width: int) -> float:
    """The flow shift diffusers' Wan 2.1 docs recommend: 5.0 at 720p and above, 3.0 at 480p (and below)."""
    return 5.0 if min(height, width) >= 720 else 3.0


@dataclasses.dataclass(frozen=True)
class WanInputs:
    """What a valid request comes to: the latent shape [B, C, F', h, w], whether CFG runs, the flow shift
    and whether the first latent frame is given (TI2V image-to-video)."""

    latent_shape: Shape
    cfg: bool
    flow_shift: float
    first_frame: bool = False

    @property
    def batch(self) -> int:
        return self.latent_shape[0]


def nearest(n: int, step: int, offset: int = 0) -> str:
    below = (n - offset) // step * step + offset
    return f"{below} or {below + step}" if below >= max(offset, 1) else f"{below + step}"


def check_inputs(
    config: WanConfig,
    parallel: ParallelConfig,
    *,
    height: int,
    width: int,
    num_frames: int,
    num_inference_steps: int,
    guidance_scale: float,
    prompt_embeds: Shape,
    negative_prompt_embeds: Shape | None = None,
    image_embeds: Shape | None = None,
    condition: Shape | None = None,
    latents: Shape | None = None,
    flow_shift: float | None = None,
    vae_scale_factor_spatial: int = 8,
    vae_scale_factor_temporal: int = 4,
    expand_timesteps: bool = False,
    two_experts: bool = False,
    guidance_scale_2: float | None = None,
) -> WanInputs:
    """Raise ``ValueError`` naming the numbers for anything a Wan generation cannot run with.

    ``expand_timesteps``: the pipeline is Wan 2.2 TI2V's (per-token timesteps, first-frame condition);
    ``two_experts``: it has a low-noise expert, the only case ``guidance_scale_2`` applies to.
    """
    validate_forward(parallel, config.num_heads)  # heads vs ulysses x tensor, no pipefusion
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    if flow_shift is not None and not flow_shift > 0:
        raise ValueError(f"flow_shift must be > 0, got {flow_shift}")
    if guidance_scale_2 is not None:
        if not two_experts:
            raise ValueError(
                "guidance_scale_2 is the low-noise expert's guidance scale: only two-expert Wan 2.2 pipelines "
                "(A14B, with a boundary_ratio) take it"
            )
        if not math.isfinite(float(guidance_scale_2)):
            raise ValueError(f"guidance_scale_2 must be a finite number, got {guidance_scale_2}")
    pt, ph, pw = config.patch_size
    s, t = vae_scale_factor_spatial, vae_scale_factor_temporal
    for name, size, multiple in (("height", height, s * ph), ("width", width, s * pw)):
        if size < multiple or size % multiple:
            raise ValueError(
                f"{name} {size} must be a positive multiple of {multiple} (VAE factor {s} x patch "
                f"{multiple // s}); nearest: {nearest(size, multiple)}"
            )
    if num_frames < 1 or (num_frames - 1) % t:
        raise ValueError(
            f"num_frames {num_frames} must be {t}n + 1 (the VAE keeps the first frame and folds every {t} "
            f"after it into one latent frame); nearest: {nearest(num_frames, t, 1)}"
        )
    frames = (num_frames - 1) // t + 1
    if frames % pt:
        raise ValueError(f"{frames} latent frames are not a multiple of the temporal patch {pt}")

    if len(prompt_embeds) != 3 or min(prompt_embeds) < 1 or prompt_embeds[2] != config.text_dim:
        raise ValueError(
            f"prompt_embeds has shape {tuple(prompt_embeds)}; expected [B, T, {config.text_dim}]"
        )
    batch = prompt_embeds[0]
    if batch % parallel.data:
        raise ValueError(f"{batch} videos cannot be split over data={parallel.data}")
    cfg = guidance_scale > 1.0
    if cfg and negative_prompt_embeds is None:
        raise ValueError(
            f"guidance_scale {guidance_scale} > 1 runs classifier-free guidance, which needs negative "
            "conditioning: pass negative_prompt_embeds (Wan's default negative is the encoded empty prompt), "
            "or guidance_scale=1 for no guidance"
        )
    if cfg and tuple(negative_prompt_embeds) != tuple(prompt_embeds):
        raise ValueError(
            f"negative_prompt_embeds {tuple(negative_prompt_embeds)} differ from prompt_embeds "
            f"{tuple(prompt_embeds)}; both branches run in one batch (Wan pads both to 512 tokens)"
        )
    if parallel.cfg == 2 and not cfg:
        raise ValueError(
            f"cfg=2 (--use_cfg_parallel) puts the conditional and unconditional branches on two devices, but "
            f"guidance_scale {guidance_scale} <= 1 runs no guidance; use guidance_scale > 1 with negative "
            "conditioning, or put the devices on ulysses/ring instead"
        )

    latent = (batch, config.out_channels, frames, height // s, width // s)
    if latents is not None and tuple(latents) != latent:
        raise ValueError(f"latents have shape {tuple(latents)}; this request needs {latent}")
    _check_image(config, batch, latent, image_embeds, condition, expand_timesteps)
    shift = flow_shift if flow_shift is not None else default_flow_shift(height, width)
    first_frame = expand_timesteps and condition is not None
    return WanInputs(latent_shape=latent, cfg=cfg, flow_shift=shift, first_frame=first_frame)


def _check_image(
    config: WanConfig,
    batch: int,
    latent: Shape,
    image_embeds: Shape | None,
    condition: Shape | None,
    expand_timesteps: bool,
) -> None:
    """The image conditions of the variant (see the module docstring)."""
    extra = config.condition_channels
    if extra < 0:
        raise ValueError(
            f"in_channels {config.in_channels} < out_channels {config.out_channels}: not a Wan model"
        )
    if expand_timesteps:
        if extra:
            raise ValueError(
                f"expand_timesteps (TI2V) with a {config.in_channels}-channel transformer: TI2V reads the "
                f"latent alone ({config.out_channels} channels) and conditions by replacing the first frame"
            )
        if image_embeds is not None:
            raise ValueError(
                "image_embeds (CLIP features) are for Wan 2.1 I2V; a TI2V model has no image path"
            )
        want = (batch, config.out_channels, 1, *latent[3:])
        if condition is not None and tuple(condition) != want:
            raise ValueError(
                f"condition has shape {tuple(condition)}; TI2V's is the first frame's latent {want}"
            )
        return
    if extra:
        needs = "image_embeds (CLIP features [B, 257, 1280]) and condition" if config.is_i2v else "condition"
        if condition is None or (config.is_i2v and image_embeds is None):
            raise ValueError(
                f"an I2V model needs {needs} (mask + VAE latent of the first frame, [B, {extra}, F', H/8, W/8])"
            )
        if config.is_i2v and (
            len(image_embeds) != 3 or image_embeds[0] != batch or image_embeds[2] != config.image_dim
        ):
            raise ValueError(
                f"image_embeds has shape {tuple(image_embeds)}; expected [{batch}, I, {config.image_dim}]"
            )
        if not config.is_i2v and image_embeds is not None:
            raise ValueError("image_embeds given, but this I2V model (Wan 2.2 A14B) has no CLIP image path")
        want = (batch, extra, *latent[2:])
        if tuple(condition) != want:
            raise ValueError(f"condition has shape {tuple(condition)}; this request needs {want}")
        return
    if image_embeds is not None or condition is not None:
        raise ValueError("image_embeds / condition are for I2V models; this is a text-to-video model")
    if config.is_i2v:
        raise ValueError(
            f"in_channels {config.in_channels} == out_channels but an image_dim: not a Wan configuration"
        )
