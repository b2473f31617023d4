"""Wan 2.1 video generation with PipeFusion (arXiv 2405.14430): ``WanPipeline``'s call over the runner.

The machinery is in ``jaxdit.pipelines.pipefusion``: the runner (warm-up steps, then one pipelined call),
and Wan's adapter (``pipefusion/wan.py``: stages, patches of latent rows or frames, per-patch UniPC
state, cost terms), whose names are re-exported here. This module checks a request (embeddings, CFG,
frames, flow shift, seed) as ``WanPipeline`` does, turns it into the runner's inputs and its latent
tokens back into a latent video.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxdit.loading import _mesh
from jaxdit.mesh import ParallelConfig
from jaxdit.models import wan
from jaxdit.parallel.cfg import interleave_branches
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.flux import GenerationOutput
from jaxdit.pipelines.pipefusion.runner import PipeFusionRunner, RunnerPrograms
from jaxdit.pipelines.pipefusion.wan import (
    PASSES,
    Geometry,
    PipeFusionWan,
    WanFamily,
    collective_bytes,
    default_num_patches,
    lower,
    make_programs,
    padded_config,
    validate_patches,
)
from jaxdit.pipelines.wan import check_inputs, swap_features
from jaxdit.samplers import unipc
from jaxdit.samplers.sampler import UniPCSampler

__all__ = [
    "PASSES",
    "Geometry",
    "PipeFusionWan",
    "PipeFusionWanPipeline",
    "collective_bytes",
    "default_num_patches",
    "lower",
    "make_programs",
    "padded_config",
    "validate_patches",
]


class PipeFusionWanPipeline(RunnerPrograms):
    """``WanPipeline``'s call (embeddings, CFG, frames, flow shift, seed) with PipeFusion.

    The request is checked by ``jaxdit.pipelines.wan.check_inputs`` plus the patch checks; the denoising
    loop is the PipeFusion runner's. ``num_pipeline_patch`` defaults to the smallest M >= P that splits
    the rows (a full pipeline); ``warmup_steps`` to 1 (xDiT's).
    """

    def __init__(
        self,
        model: PipeFusionWan,
        *,
        scheduler: unipc.UniPCConfig | None = None,
        decode: Callable[[np.ndarray], np.ndarray] | None = None,
        vae_scale_factor_spatial: int = 8,
        vae_scale_factor_temporal: int = 4,
        kernel: dict[str, int] | None = None,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.config = model.config
        self.mesh = model.mesh
        self.parallel = model.parallel
        self.scheduler = scheduler
        self.decode = decode
        self.vae_scale_factor_spatial = vae_scale_factor_spatial
        self.vae_scale_factor_temporal = vae_scale_factor_temporal
        self.runner = PipeFusionRunner(
            WanFamily(model.config), model, kernel=kernel, compiler_options=compiler_options
        )

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        parallel: ParallelConfig | Mesh,
        dtype: Any = None,
        *,
        preset: str | None = None,
        **kwargs: Any,
    ) -> PipeFusionWanPipeline:
        return cls(PipeFusionWan.load(path, _mesh(parallel), dtype, preset=preset), **kwargs)

    def __call__(
        self,
        *,
        prompt_embeds: np.ndarray,
        negative_prompt_embeds: np.ndarray | None = None,
        image_embeds: np.ndarray | None = None,
        condition: np.ndarray | None = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        flow_shift: float | None = None,
        seed: int = 0,
        latents: np.ndarray | None = None,
        output_type: str = "latent",
        progress: bool = True,
        num_pipeline_patch: int | None = None,
        warmup_steps: int = 1,
        patch_by: str = "rows",
    ) -> GenerationOutput:
        """Generate videos (latents [B, 16, F', H/8, W/8]; ``images`` when a decoder is given)."""
        if output_type not in ("np", "latent"):
            raise ValueError(f"output_type must be 'np' or 'latent', got {output_type!r}")
        if output_type == "np" and self.decode is None:
            raise ValueError("this pipeline has no decoder (VAE): use output_type='latent'")
        pc, mc = self.parallel, self.config
        if flow_shift is None and self.scheduler is not None:
            flow_shift = self.scheduler.flow_shift
        txt = np.asarray(prompt_embeds, np.float32)
        neg = None if negative_prompt_embeds is None else np.asarray(negative_prompt_embeds, np.float32)
        plan = check_inputs(
            mc,
            dataclasses.replace(pc, pipefusion=1),  # the blocks' split is this pipeline's business
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            prompt_embeds=txt.shape,
            negative_prompt_embeds=None if neg is None or guidance_scale <= 1.0 else neg.shape,
            image_embeds=None if image_embeds is None else np.shape(image_embeds),
            condition=None if condition is None else np.shape(condition),
            latents=None if latents is None else np.shape(latents),
            flow_shift=flow_shift,
            vae_scale_factor_spatial=self.vae_scale_factor_spatial,
            vae_scale_factor_temporal=self.vae_scale_factor_temporal,
        )
        grid = wan.latent_grid(plan.latent_shape, mc.patch_size)
        patches = self.runner.check(
            grid, num_inference_steps, warmup_steps, num_pipeline_patch, patch_by=patch_by
        )

        if plan.cfg:
            txt = np.asarray(interleave_branches(neg, txt, pc.data))
        context = {"encoder_hidden_states": txt, "positions": wan.token_positions(grid)}
        if mc.is_i2v:
            # Both branches see the same image; only the text differs (as in diffusers).
            img = np.asarray(image_embeds, np.float32)
            context["encoder_hidden_states_image"] = (
                np.asarray(interleave_branches(img, img, pc.data)) if plan.cfg else img
            )
            context["condition"] = wan.patchify(np.asarray(condition, np.float32), mc.patch_size)
        noise = latent_ops.initial_noise(seed, plan.latent_shape) if latents is None else latents
        sampler = UniPCSampler(
            dataclasses.replace(self.scheduler or unipc.UniPCConfig(), flow_shift=plan.flow_shift)
        )
        start = time.perf_counter()
        tokens = self.runner(
            wan.patchify(np.asarray(noise, np.float32), mc.patch_size),
            context,
            sampler=sampler,
            schedule=sampler.schedule(num_inference_steps),
            grid=grid,
            guidance_scale=guidance_scale,
            num_inference_steps=num_inference_steps,
            warmup_steps=warmup_steps,
            num_pipeline_patch=patches,
            progress=progress,
            patch_by=patch_by,
        )
        seconds = time.perf_counter() - start
        tokens = swap_features(tokens, mc.out_channels, math.prod(mc.patch_size))
        out = np.asarray(wan.unpatchify(tokens, grid, mc.patch_size, mc.out_channels))
        video = self.decode(out) if output_type == "np" else None
        return GenerationOutput(images=video, latents=out, seconds=seconds)
