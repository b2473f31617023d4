"""Text-to-image sampling with a FLUX transformer on a mesh (diffusers' ``FluxPipeline`` call).

What is FLUX's own: the conditioning (T5 tokens + CLIP pooled vector per prompt; FLUX-dev's embedded
guidance scale; true classifier-free guidance against a negative prompt when ``true_cfg_scale > 1``),
the latents (``[B, 16, H/8, W/8]`` packed into 2x2-patch tokens with (0, row, col) positions, text at
(0, 0, 0)) and the flow-matching Euler sampler with FLUX's dynamic shift. The loop, decoding and output
types are :class:`~jaxdit.pipelines.base.DiffusionPipeline`'s.

The initial noise comes from the seed alone (host, fp32), so the same seed gives the same picture on
every mesh. Text encoders and the VAE plug in as callables: ``encode(prompts) -> (tokens [B, T, C],
pooled [B, P])`` and ``decode(latents [B, C, h, w]) -> images [B, H, W(, 3)] in [-1, 1]``; without an
encoder the call takes ``prompt_embeds``, without a decoder ``output_type="latent"`` is the only choice
(the bundled ``tiny-digits`` model works in pixel space: its decoder drops the channel axis).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from converters.flux import CHECKPOINTS
from jaxdit.loading.flux import load_flux_text_encoders
from jaxdit.loading.vae import load_flux_vae
from jaxdit.mesh import DeviceMesh, ParallelConfig
from jaxdit.models import flux
from jaxdit.parallel.kernels import check_kernel_options, with_backend
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.assemble import as_dtype, check_transformer, load_model
from jaxdit.pipelines.base import DiffusionPipeline, GenerationOutput, Prepared
from jaxdit.pipelines.denoiser import DenoiseInputs
from jaxdit.pipelines.model_folder import FolderClass, open_diffusers_folder
from jaxdit.pipelines.pipefusion.flux import FluxPatches, PipeFusionFlux
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.samplers import flow_match_euler as euler
from jaxdit.samplers.sampler import EulerSampler

__all__ = ["DEFAULT_SCHEDULER", "FOLDER_CLASSES", "FluxPipeline", "GenerationOutput"]

Encoder = Callable[[Sequence[str]], tuple[np.ndarray, np.ndarray]]
Decoder = Callable[[np.ndarray], np.ndarray]

#: The diffusers pipeline classes this module runs from a downloaded folder.
FOLDER_CLASSES = {
    "FluxPipeline": FolderClass(
        "flux",
        "flux",
        ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"),
        classes={"transformer": ("FluxTransformer2DModel",), "vae": ("AutoencoderKL",)},
    )
}

#: FLUX.1's scheduler (diffusers' FLUX.1-dev scheduler_config.json): dynamic shift from 0.5 to 1.15.
DEFAULT_SCHEDULER = euler.FlowMatchEulerConfig(
    shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15
)


class FluxPipeline(DiffusionPipeline):
    """A FLUX transformer on a mesh plus a sampler, optional encoder and decoder.

    Args:
      model: a ``FluxTransformer`` placed for ``mesh`` (``jaxdit.loading.load_params``), or on a mesh with
        ``pipefusion > 1`` its stage layout (``jaxdit.pipelines.pipefusion``).
      mesh: from ``ParallelConfig.make_mesh``.
      scheduler: flow-matching Euler settings (FLUX-dev: dynamic shift; the tiny model: shift 1).
      latent_channels / vae_scale_factor: latent shape = [channels, H / f, W / f] (FLUX: 16, 8).
      kernel: attention kernel options; compiler_options: XLA options for the compiled step.
    """

    cfg_hint = "pass a negative prompt and true_cfg_scale > 1"
    default_size = (1024, 1024)  # FLUX.1's, as diffusers computes it: default_sample_size 128 x the VAE's 8
    checkpoints = CHECKPOINTS
    staged_model = PipeFusionFlux
    pipefusion_caches = frozenset({"magcache", "taylorseer"})  # host-planned: pipelines/pipefusion/cache.py

    def __init__(
        self,
        model: Any,
        mesh: Mesh,
        *,
        scheduler: euler.FlowMatchEulerConfig | None = None,
        encode: Encoder | None = None,
        decode: Decoder | None = None,
        latent_channels: int = 16,
        vae_scale_factor: int = 8,
        kernel: dict[str, int] | None = None,
        compiler_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(mesh, encode=encode, decode=decode)
        self.model = model
        self.config: flux.FluxConfig = model.config
        self.scheduler = scheduler or DEFAULT_SCHEDULER
        self.sampler = EulerSampler(self.scheduler)
        self.latent_channels = latent_channels
        self.vae_scale_factor = vae_scale_factor
        self.compiler_options = compiler_options
        # Under PipeFusion ``model`` is the stage layout (PipeFusionFlux) and there is no plain forward.
        self.forward = self.plain_forward(flux.sharded, model, kernel)
        self.denoiser = self.denoiser_for(
            model, self.sampler, patches=FluxPatches, kernel=kernel, compiler_options=compiler_options
        )

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        parallel: ParallelConfig | Mesh | None = None,
        dtype: Any = None,
        *,
        encoder_device: jax.Device | None = None,
        kernel: dict[str, Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
        attention_backend: str | None = None,
        fp8: str | None = None,
        offload_encoders: bool = False,
    ) -> FluxPipeline:
        """A downloaded FLUX.1 diffusers pipeline folder (``model_index.json``, ``transformer/``, ``vae/``,
        ``text_encoder{,_2}/``, ``tokenizer{,_2}/``, ``scheduler/``) on the mesh of ``parallel``.

        The transformer is sharded over the mesh; the text encoders run on ``encoder_device`` (default: the
        first local device); the VAE decodes patch-parallel over the mesh (``jaxdit.pipelines.assemble``).
        The transformer's heads and key table are checked before anything is read.
        ``attention_backend``: auto, xla, cudnn, triton or splash (``jaxdit.parallel.kernels``).
        ``fp8``: ``"weight"`` or ``"matmul"``: the transformer blocks' linear layers in FP8
        (``jaxdit.models.fp8``; plain meshes, not PipeFusion).
        ``offload_encoders``: the text encoders' weights wait in host memory between prompts (copied to
        ``encoder_device`` for each encode), leaving the device to the transformer.
        """
        kernel = with_backend(kernel, attention_backend)
        check_kernel_options(kernel)
        folder = open_diffusers_folder(Path(path), FOLDER_CLASSES)
        where = DeviceMesh.of(parallel)
        mesh = where.mesh
        check_transformer(folder["transformer"], where, CHECKPOINTS)
        dtype = as_dtype(dtype)
        encoders = load_flux_text_encoders(
            folder.root,
            dtype=dtype,
            device=encoder_device,
            compiler_options=compiler_options,
            offload=offload_encoders,
        )
        vae = load_flux_vae(folder["vae"], dtype=dtype, compiler_options=compiler_options)
        model = load_model(folder["transformer"], where, dtype, CHECKPOINTS, staged=PipeFusionFlux, fp8=fp8)
        return cls(
            model,
            where,
            scheduler=euler.FlowMatchEulerConfig.from_diffusers(folder.scheduler_config),
            encode=encoders,
            decode=lambda z: np.asarray(vae.decode_latents(z, mesh=mesh)),
            latent_channels=model.config.in_channels // 4,
            vae_scale_factor=2 ** (len(vae.config.block_out_channels) - 1),
            kernel=kernel,
            compiler_options=compiler_options,
        )

    # ------------------------------------------------------------------ call
    def __call__(
        self,
        prompt: str | Sequence[str] | None = None,
        *,
        prompt_embeds: np.ndarray | None = None,
        pooled_prompt_embeds: np.ndarray | None = None,
        negative_prompt: str | Sequence[str] | None = None,
        negative_prompt_embeds: np.ndarray | None = None,
        negative_pooled_prompt_embeds: np.ndarray | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 28,
        guidance_scale: float = 3.5,
        true_cfg_scale: float = 1.0,
        seed: int = 0,
        latents: np.ndarray | None = None,
        num_images_per_prompt: int = 1,
        max_sequence_length: int | None = None,
        output_type: str = "np",
        progress: bool = True,
        callback: Callable[[int, int], bool | None] | None = None,
        num_pipeline_patch: int | None = None,
        warmup_steps: int | None = None,
        cache: Any = None,
    ) -> GenerationOutput:
        """Generate images. ``guidance_scale`` feeds FLUX-dev's guidance embedding (ignored by models
        without one); ``true_cfg_scale`` > 1 with negative conditioning runs classifier-free guidance.
        ``latents``: initial noise [B, C, H/f, W/f] instead of the seed's. ``max_sequence_length``: T5's
        token count (default: the text encoder's, 512 for FLUX). ``output_type``: np, pil or latent.
        PipeFusion (a mesh with pipefusion > 1): ``num_pipeline_patch`` (default 2P when it divides the
        latent's token rows, else P) and ``warmup_steps`` (default 1), as xDiT's flags.
        ``cache``: a feature cache, ``jaxdit.cache.FirstBlockCache(threshold=0.08)`` or ``TeaCache()`` (the
        output's ``cache`` reports what it skipped)."""
        return self.generate(GenerationRequest(**{k: v for k, v in locals().items() if k != "self"}))

    # ------------------------------------------------------------------ family hook
    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        f = self.vae_scale_factor
        if height % (2 * f) or width % (2 * f):
            raise ValueError(
                f"height and width must be multiples of {2 * f} (VAE factor {f} x 2x2 patches); got {height}x{width}"
            )
        return height // f, width // f

    def prepare(self, r: GenerationRequest) -> Prepared:
        txt, pooled = self._conditioning(r.prompt, r.prompt_embeds, r.pooled_prompt_embeds, r)
        has_negative = r.negative_prompt is not None or r.negative_prompt_embeds is not None
        cfg = has_negative and r.true_cfg_scale > 1.0
        self.check_cfg(cfg)
        if cfg:
            neg_txt, neg_pooled = self._conditioning(
                r.negative_prompt, r.negative_prompt_embeds, r.negative_pooled_prompt_embeds, r, len(txt)
            )
            if neg_txt.shape != txt.shape:
                raise ValueError(
                    f"negative prompt embeddings {neg_txt.shape} differ from the prompt's {txt.shape}"
                )
            batch = len(txt)
            txt, pooled = self.branches(neg_txt, txt), self.branches(neg_pooled, pooled)
        else:
            batch = len(txt)
        h, w = self.latent_size(r.height, r.width)
        self.check_batch(batch)
        shape = (batch, self.latent_channels, h, w)
        if r.latents is not None and np.shape(r.latents) != shape:
            raise ValueError(f"latents have shape {np.shape(r.latents)}; this request needs {shape}")
        noise = latent_ops.initial_noise(r.seed, shape) if r.latents is None else np.asarray(r.latents)
        tokens = latent_ops.pack(np.asarray(noise, np.float32))
        context = {
            "encoder_hidden_states": txt,
            "pooled_projections": pooled,
            "img_ids": latent_ops.image_positions(h, w),
            "txt_ids": latent_ops.text_positions(txt.shape[1]),
        }
        if self.config.guidance_embed:
            context["guidance"] = np.full((len(txt),), r.guidance_scale, np.float32)
        inputs = DenoiseInputs(
            tokens=tokens,
            context=context,
            schedule=self.sampler.schedule(r.num_inference_steps, image_seq_len=tokens.shape[1]),
            steps=r.num_inference_steps,
            cfg=cfg,
            scale=r.true_cfg_scale,
            grid=(h // 2, w // 2),
        )
        return Prepared(inputs, lambda t: latent_ops.unpack(t, h, w))

    def _conditioning(
        self, prompt, embeds, pooled, r: GenerationRequest, batch: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        if prompt is not None:
            if embeds is not None:
                raise ValueError("pass either a prompt or prompt embeddings, not both")
            if self.encode is None:
                raise ValueError(
                    "this pipeline has no text encoder: pass prompt_embeds and pooled_prompt_embeds"
                )
            embeds, pooled = self.encode_prompts(prompt, r, batch=batch)
        else:
            embeds, pooled = self.repeat_per_prompt(embeds, r), self.repeat_per_prompt(pooled, r)
        if embeds is None or pooled is None:
            raise ValueError("pass a prompt, or both prompt_embeds [B, T, C] and pooled_prompt_embeds [B, P]")
        embeds, pooled = np.asarray(embeds, np.float32), np.asarray(pooled, np.float32)
        if embeds.ndim != 3 or pooled.ndim != 2 or embeds.shape[0] != pooled.shape[0]:
            raise ValueError(
                f"prompt embeddings {embeds.shape} and pooled {pooled.shape} do not match [B,T,C], [B,P]"
            )
        return embeds, pooled
