"""The toy family's pipeline: prompt embeddings in, latents (or pictures) out, on the shared loop.

Only ``prepare`` is the toy's own (``jaxdit.pipelines.base.DiffusionPipeline`` runs the call, the plain
``Denoiser`` the steps): latents ``[B, C, h, w]`` (noise from ``numpy default_rng(seed)``, the project's
convention) become one token per latent pixel with its (row, col) RoPE position; text tokens sit at
(0, 0); classifier-free guidance against ``negative_prompt_embeds`` when ``guidance_scale > 1``; the
flow-matching Euler sampler without a shift. Its "VAE" is the identity on the first three channels
(pictures in [-1, 1]), enough to show ``output_type="np"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxdit.pipelines.base import DiffusionPipeline, GenerationOutput, Prepared
from jaxdit.pipelines.call_options import CallOption
from jaxdit.pipelines.denoiser import DenoiseInputs, Denoiser
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.samplers.flow_match_euler import FlowMatchEulerConfig
from jaxdit.samplers.sampler import EulerSampler

from . import model as toy_model
from .converter import CHECKPOINTS

#: Pixels per latent pixel (the toy's "VAE" keeps the size).
VAE_FACTOR = 1


def decode_pictures(latents: np.ndarray) -> np.ndarray:
    """[B, C, h, w] -> pictures [B, h, w, 3] in [-1, 1] (the first three channels, squashed)."""
    return np.tanh(np.moveaxis(np.asarray(latents)[:, :3], 1, -1))


def positions(h: int, w: int) -> np.ndarray:
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return np.stack([rows, cols], -1).reshape(-1, 2).astype(np.float32)


class ToyPipeline(DiffusionPipeline):
    cfg_hint = "pass negative_prompt_embeds and guidance_scale > 1"
    default_size = (8, 8)
    checkpoints = CHECKPOINTS
    staged_model = None
    #: The toy's own call argument and ``jaxdit generate`` flag: declared here, parsed, checked and passed
    #: on by the shared code without it naming them.
    call_options = (CallOption("embedding_scale", "multiply the prompt embeddings by this", type=float),)

    def __init__(
        self,
        model: Any,
        mesh: Mesh,
        *,
        decode: Callable[[np.ndarray], np.ndarray] | None = decode_pictures,
        kernel: dict[str, Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(mesh, decode=decode)
        self.model = model
        self.config: toy_model.ToyConfig = model.config
        self.sampler = EulerSampler(FlowMatchEulerConfig(shift=1.0))
        self.forward = toy_model.sharded(model, mesh, kernel=kernel)
        self.denoiser = Denoiser(
            self.forward, self.sampler, dtype=model.dtype, compiler_options=compiler_options
        )

    def __call__(
        self,
        *,
        prompt_embeds: np.ndarray | None = None,
        negative_prompt_embeds: np.ndarray | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 4,
        guidance_scale: float = 1.0,
        seed: int = 0,
        latents: np.ndarray | None = None,
        num_images_per_prompt: int = 1,
        output_type: str = "np",
        progress: bool = False,
        callback: Callable[[int, int], bool | None] | None = None,
        cache: Any = None,
        embedding_scale: float = 1.0,
    ) -> GenerationOutput:
        """``embedding_scale``: the toy's own argument (no shared file names it): multiplies the prompt
        embeddings of both guidance branches."""
        return self.generate(GenerationRequest.of(**{k: v for k, v in locals().items() if k != "self"}))

    def prepare(self, r: GenerationRequest) -> Prepared:
        if r.prompt is not None or r.prompt_embeds is None:
            raise ValueError("the toy pipeline has no text encoder: pass prompt_embeds [B, T, text_dim]")
        scale = np.float32(r.family_arguments["embedding_scale"])  # with_defaults filled it in
        txt = np.asarray(self.repeat_per_prompt(r.prompt_embeds, r), np.float32) * scale
        if txt.ndim != 3 or txt.shape[-1] != self.config.text_dim:
            raise ValueError(
                f"prompt_embeds has shape {txt.shape}; this model takes [B, T, {self.config.text_dim}]"
            )
        cfg = r.negative_prompt_embeds is not None and r.guidance_scale > 1.0
        self.check_cfg(cfg)
        batch = len(txt)
        if cfg:
            neg = np.asarray(self.repeat_per_prompt(r.negative_prompt_embeds, r), np.float32) * scale
            if neg.shape != txt.shape:
                raise ValueError(f"negative_prompt_embeds {neg.shape} differ from prompt_embeds {txt.shape}")
            txt = self.branches(neg, txt)
        self.check_batch(batch)
        h, w = r.height // VAE_FACTOR, r.width // VAE_FACTOR
        shape = (batch, self.config.in_channels, h, w)
        if r.latents is not None and np.shape(r.latents) != shape:
            raise ValueError(f"latents have shape {np.shape(r.latents)}; this request needs {shape}")
        noise = np.random.default_rng(r.seed).standard_normal(shape, dtype=np.float32)
        noise = noise if r.latents is None else np.asarray(r.latents, np.float32)
        tokens = noise.reshape(batch, shape[1], h * w).transpose(0, 2, 1)
        context = {
            "encoder_hidden_states": txt,
            "img_pos": positions(h, w),
            "txt_pos": np.zeros((txt.shape[1], 2), np.float32),
        }
        inputs = DenoiseInputs(
            tokens=np.ascontiguousarray(tokens),
            context=context,
            schedule=self.sampler.schedule(r.num_inference_steps, image_seq_len=h * w),
            steps=r.num_inference_steps,
            cfg=cfg,
            scale=r.guidance_scale,
            grid=(h, w),
        )
        return Prepared(inputs, lambda t: np.asarray(t).transpose(0, 2, 1).reshape(len(t), -1, h, w))
