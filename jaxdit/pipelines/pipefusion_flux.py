"""FLUX.1 text-to-image with PipeFusion (arXiv 2405.14430): ``FluxPipeline``'s call over the PipeFusion runner.

The machinery is in ``jaxdit.pipelines.pipefusion``: the runner (warm-up steps, then one pipelined call),
and FLUX's adapter (``pipefusion/flux.py``: stages, patches of text chunks and image rows, cost terms),
whose names are re-exported here. This module turns a request (prompts or embeddings, true CFG, seed)
into the runner's inputs and its latents into images.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxdit.loading import _mesh
from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.cfg import interleave_branches
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines import tiny_digits as tiny
from jaxdit.pipelines.flux import Decoder, Encoder, FluxPipeline, GenerationOutput
from jaxdit.pipelines.pipefusion.flux import (
    PASSES,
    STACKS,
    FluxFamily,
    Geometry,
    PipeFusionFlux,
    collective_bytes,
    default_num_patches,
    lower,
    make_programs,
    padded_config,
    validate_patches,
)
from jaxdit.pipelines.pipefusion.runner import PipeFusionRunner, RunnerPrograms
from jaxdit.samplers import flow_match_euler as euler
from jaxdit.samplers.sampler import EulerSampler

__all__ = [
    "PASSES",
    "STACKS",
    "Geometry",
    "PipeFusionFlux",
    "PipeFusionFluxPipeline",
    "collective_bytes",
    "default_num_patches",
    "lower",
    "make_programs",
    "padded_config",
    "tiny_digits",
    "validate_patches",
]


class PipeFusionFluxPipeline(FluxPipeline, RunnerPrograms):
    """``FluxPipeline``'s call (prompts or embeddings, true CFG, seed, output type) with PipeFusion.

    Reuses ``FluxPipeline``'s request checks and conditioning; the denoising loop is the PipeFusion
    runner's (``jaxdit.pipelines.pipefusion.runner``). ``num_pipeline_patch`` defaults to 2P when it
    divides the latent rows (a full pipeline), else P; ``warmup_steps`` to 1 (xDiT's default).
    """

    def __init__(
        self,
        model: PipeFusionFlux,
        *,
        scheduler: euler.FlowMatchEulerConfig | None = None,
        encode: Encoder | None = None,
        decode: Decoder | None = None,
        latent_channels: int = 16,
        vae_scale_factor: int = 8,
        kernel: dict[str, int] | None = None,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> None:
        # Not FluxPipeline.__init__: its plain sharded forward needs every layer on every device.
        self.model = model
        self.mesh = model.mesh
        self.parallel = model.parallel
        self.scheduler = scheduler or euler.FlowMatchEulerConfig(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15
        )
        self.encode = encode
        self.decode = decode
        self.latent_channels = latent_channels
        self.vae_scale_factor = vae_scale_factor
        self.runner = PipeFusionRunner(
            FluxFamily(model.config), model, kernel=kernel, compiler_options=compiler_options
        )

    def __call__(
        self,
        prompt: str | list[str] | None = None,
        *,
        prompt_embeds: np.ndarray | None = None,
        pooled_prompt_embeds: np.ndarray | None = None,
        negative_prompt: str | list[str] | None = None,
        negative_prompt_embeds: np.ndarray | None = None,
        negative_pooled_prompt_embeds: np.ndarray | None = None,
        height: int = 1024,
        width: int = 1024,
        num_inference_steps: int = 28,
        guidance_scale: float = 3.5,
        true_cfg_scale: float = 1.0,
        seed: int = 0,
        output_type: str = "np",
        progress: bool = True,
        num_pipeline_patch: int | None = None,
        warmup_steps: int = 1,
    ) -> GenerationOutput:
        """Generate images; ``num_pipeline_patch`` and ``warmup_steps`` as xDiT's flags."""
        if output_type not in ("np", "latent"):
            raise ValueError(f"output_type must be 'np' or 'latent', got {output_type!r}")
        if output_type == "np" and self.decode is None:
            raise ValueError("this pipeline has no decoder (VAE): use output_type='latent'")
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        pc = self.parallel
        h, w = self._latent_size(height, width)
        grid = (h // 2, w // 2)  # rows x cols of packed 2x2 tokens
        patches = self.runner.check(grid, num_inference_steps, warmup_steps, num_pipeline_patch)

        txt, pooled = self._conditioning(prompt, prompt_embeds, pooled_prompt_embeds)
        has_negative = negative_prompt is not None or negative_prompt_embeds is not None
        true_cfg = has_negative and true_cfg_scale > 1.0
        self._check_cfg(true_cfg)
        if true_cfg:
            neg_txt, neg_pooled = self._conditioning(
                negative_prompt, negative_prompt_embeds, negative_pooled_prompt_embeds, batch=txt.shape[0]
            )
            if neg_txt.shape != txt.shape:
                raise ValueError(
                    f"negative prompt embeddings {neg_txt.shape} differ from the prompt's {txt.shape}"
                )
            txt = np.asarray(interleave_branches(neg_txt, txt, pc.data))
            pooled = np.asarray(interleave_branches(neg_pooled, pooled, pc.data))
        batch = txt.shape[0] // (2 if true_cfg else 1)
        if batch % pc.data:
            raise ValueError(f"{batch} images cannot be split over data={pc.data}")

        context = {
            "encoder_hidden_states": txt,
            "pooled_projections": pooled,
            "txt_ids": latent_ops.text_positions(txt.shape[1]),
            "img_ids": latent_ops.image_positions(h, w),
        }
        if self.model.config.guidance_embed:
            context["guidance"] = np.full((txt.shape[0],), guidance_scale, np.float32)
        noise = latent_ops.initial_noise(seed, (batch, self.latent_channels, h, w))
        sampler = EulerSampler(self.scheduler)
        start = time.perf_counter()
        tokens = self.runner(
            latent_ops.pack(noise),
            context,
            sampler=sampler,
            schedule=sampler.schedule(num_inference_steps, image_seq_len=grid[0] * grid[1]),
            grid=grid,
            guidance_scale=true_cfg_scale,
            num_inference_steps=num_inference_steps,
            warmup_steps=warmup_steps,
            num_pipeline_patch=patches,
            progress=progress,
        )
        seconds = time.perf_counter() - start
        out = latent_ops.unpack(tokens, h, w)
        images = self.decode(out) if output_type == "np" else None
        return GenerationOutput(images=images, latents=out, seconds=seconds)


def tiny_digits(
    parallel: ParallelConfig | Mesh, folder: str | Path | None = None, **options: Any
) -> PipeFusionFluxPipeline:
    """The bundled ``tiny-digits`` model with PipeFusion (see ``jaxdit.pipelines.flux.tiny_digits``)."""
    mesh = parallel if isinstance(parallel, Mesh) else _mesh(parallel)
    folder = folder or tiny.asset_dir()
    model = PipeFusionFlux.load(folder, mesh, np.float32)
    labels = tiny.LabelEncoder.load(folder)

    def encode(prompts):
        ids = [label for p in prompts for label in tiny.parse_prompt(p)]
        return labels(ids)

    return PipeFusionFluxPipeline(
        model,
        scheduler=euler.FlowMatchEulerConfig(shift=1.0),
        encode=encode,
        decode=lambda z: z[:, 0],
        latent_channels=tiny.LATENT_CHANNELS,
        vae_scale_factor=1,
        **options,
    )
