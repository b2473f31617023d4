"""Text-to-image sampling with a Z-Image transformer on a mesh (diffusers' ``ZImagePipeline`` call).

What is Z-Image's own: the conditioning (one Qwen3 feature array per prompt, each its own length:
``text_encoders/z_image_prompt.py``), the token sequence (``models/z_image_tokens.py``), the model's time
and sign (it sees (1000 - t) / 1000 and predicts clean minus noise: ``models/z_image.py``'s sampler
view), and guidance: diffusers' ``pos + g (pos - neg)`` for g > 0 is the shared ``neg + s (pos - neg)``
with s = 1 + g, and ``cfg_truncation`` drops guidance (s = 1: the positive branch alone) on the steps
whose normalised time (1000 - t) / 1000 exceeds it. Turbo runs with ``guidance_scale=0``: no negative
branch is computed at all. The flow-matching Euler schedule is the folder's scheduler config with
diffusers' ``linspace(1, 1/N, N)`` sigmas. The loop, decoding and output types are
:class:`~jaxdit.pipelines.base.DiffusionPipeline`'s; the initial noise is drawn on the host from the seed
in the latent grid [B, C, H/8, W/8] (FLUX's AutoencoderKL decodes it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from converters.z_image import CHECKPOINTS
from jaxdit.loading.decoder_lm import load_decoder_lm
from jaxdit.loading.vae import load_flux_vae
from jaxdit.mesh import ParallelConfig, mesh_for
from jaxdit.models import z_image
from jaxdit.models.z_image_tokens import caption_inputs, image_inputs, unpack
from jaxdit.parallel.kernels import check_kernel_options, with_backend
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.assemble import as_dtype, check_transformer, load_model
from jaxdit.pipelines.base import DiffusionPipeline, GenerationOutput, Prepared
from jaxdit.pipelines.denoiser import DenoiseInputs
from jaxdit.pipelines.model_folder import FolderClass, open_diffusers_folder
from jaxdit.pipelines.pipefusion.z_image import PipeFusionZImage, ZImagePatches
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.samplers import flow_match_euler as euler
from jaxdit.samplers.sampler import EulerSampler
from jaxdit.text_encoders.decoder_lm import DecoderLMRunner
from jaxdit.text_encoders.z_image_prompt import ZImagePromptEncoder

__all__ = ["DEFAULT_SCHEDULER", "FOLDER_CLASSES", "ZImagePipeline"]

FOLDER_CLASSES = {
    "ZImagePipeline": FolderClass(
        "z-image",
        "z-image",
        ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
        classes={"transformer": ("ZImageTransformer2DModel",), "vae": ("AutoencoderKL",)},
    )
}

#: Z-Image-Turbo's scheduler_config.json: a static shift of 3.
DEFAULT_SCHEDULER = euler.FlowMatchEulerConfig(shift=3.0, use_dynamic_shifting=False)


class ZImagePipeline(DiffusionPipeline):
    """A Z-Image transformer on a mesh plus the Euler sampler, optional encoder and decoder.

    ``encode(prompts, max_sequence_length=...)`` -> one [L_i, E] array per prompt;
    ``decode(latents [B, C, h, w])`` -> images [B, H, W, 3] in [-1, 1].
    """

    cfg_hint = "pass guidance_scale > 0 (the base model; Turbo runs without guidance)"
    default_size = (1024, 1024)
    checkpoints = CHECKPOINTS
    staged_model = PipeFusionZImage
    pipefusion_caches = frozenset({"magcache", "taylorseer"})  # host-planned: pipelines/pipefusion/cache.py

    def __init__(
        self,
        model: Any,
        mesh: Mesh,
        *,
        scheduler: euler.FlowMatchEulerConfig | None = None,
        encode: Callable[..., list[np.ndarray]] | None = None,
        decode: Callable[[np.ndarray], np.ndarray] | None = None,
        vae_scale_factor: int = 8,
        kernel: dict[str, Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(mesh, encode=encode, decode=decode)
        self.model = model
        self.config = model.config
        self.scheduler = scheduler or DEFAULT_SCHEDULER
        self.sampler = EulerSampler(self.scheduler)
        self.vae_scale_factor = vae_scale_factor
        self.forward = self.plain_forward(
            lambda m, mesh, kernel: z_image.sharded(z_image.sampler_view(m), mesh, kernel=kernel),
            model,
            kernel,
        )
        # Under PipeFusion ``model`` is the stage layout (PipeFusionZImage).
        self.denoiser = self.denoiser_for(
            model, self.sampler, patches=ZImagePatches, kernel=kernel, compiler_options=compiler_options
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        parallel: ParallelConfig | Mesh | None = None,
        dtype: Any = None,
        *,
        kernel: dict[str, Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
        attention_backend: str | None = None,
    ) -> ZImagePipeline:
        """A diffusers ``ZImagePipeline`` folder (Turbo or base) on the mesh of ``parallel``: the
        transformer sharded over it, the Qwen3 encoder sharded by its own rule table on the same mesh, the
        VAE decoding patch-parallel. Heads and the key table are checked before anything is read."""
        from transformers import AutoTokenizer

        kernel = with_backend(kernel, attention_backend)
        check_kernel_options(kernel)
        folder = open_diffusers_folder(Path(path), FOLDER_CLASSES)
        mesh = mesh_for(parallel)
        check_transformer(folder["transformer"], mesh, CHECKPOINTS)
        dtype = as_dtype(dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder["tokenizer"])
        encoder = DecoderLMRunner(load_decoder_lm(folder["text_encoder"], dtype=dtype))
        vae = load_flux_vae(folder["vae"], dtype=dtype, compiler_options=compiler_options)
        model = load_model(folder["transformer"], mesh, dtype, CHECKPOINTS, staged=PipeFusionZImage)
        return cls(
            model,
            mesh,
            scheduler=euler.FlowMatchEulerConfig.from_diffusers(folder.scheduler_config),
            encode=ZImagePromptEncoder(tokenizer, encoder),
            decode=lambda z: np.asarray(vae.decode_latents(z, mesh=mesh)),
            vae_scale_factor=2 ** (len(vae.config.block_out_channels) - 1),
            kernel=kernel,
            compiler_options=compiler_options,
        )

    def __call__(
        self,
        prompt: str | Sequence[str] | None = None,
        *,
        prompt_embeds: Sequence[np.ndarray] | None = None,
        negative_prompt: str | Sequence[str] | None = None,
        negative_prompt_embeds: Sequence[np.ndarray] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        cfg_normalization: bool = False,
        cfg_truncation: float = 1.0,
        seed: int = 0,
        latents: np.ndarray | None = None,
        num_images_per_prompt: int = 1,
        max_sequence_length: int | None = None,
        output_type: str = "np",
        progress: bool = True,
        callback: Callable[[int, int], bool | None] | None = None,
        cache: Any = None,
        num_pipeline_patch: int | None = None,
        warmup_steps: int | None = None,
    ) -> GenerationOutput:
        """Generate images as diffusers' ``ZImagePipeline`` does (its defaults; Turbo: 8 steps,
        ``guidance_scale=0``). ``prompt_embeds``: one [L_i, E] array per image. ``latents``: initial noise
        [B, C, H/f, W/f] instead of the seed's. ``cfg_normalization`` (True = 1, or a factor): the guided
        prediction's norm is capped at that x the positive one's, per image, as diffusers does. PipeFusion
        (a mesh with pipefusion > 1): ``num_pipeline_patch``, ``warmup_steps``."""
        if isinstance(cfg_normalization, bool):
            cfg_normalization = 1.0 if cfg_normalization else 0.0
        if not float(cfg_normalization) >= 0.0:
            raise ValueError(
                f"cfg_normalization must be False, True or a factor >= 0, got {cfg_normalization}"
            )
        if not float(cfg_truncation) >= 0.0:
            raise ValueError(f"cfg_truncation must be >= 0, got {cfg_truncation}")
        request = dict(locals())
        for name in ("self", "cfg_normalization", "cfg_truncation"):
            request.pop(name)
        # The shared request has no fields for these two: this call's values, for ``prepare`` alone.
        self._cfg_options = (float(cfg_truncation), float(cfg_normalization))
        try:
            return self.generate(GenerationRequest(**request))
        finally:
            self._cfg_options = (1.0, 0.0)

    # ------------------------------------------------------------------ family hook
    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        f = self.vae_scale_factor * self.config.patch_size
        if height % f or width % f:
            raise ValueError(f"height and width must be multiples of {f}; got {height}x{width}")
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    def _captions(self, prompt, embeds, r: GenerationRequest, batch: int | None = None) -> list[np.ndarray]:
        if prompt is not None:
            if embeds is not None:
                raise ValueError("pass either a prompt or prompt embeddings, not both")
            return [np.asarray(e, np.float32) for e in self.encode_prompts(prompt, r, batch=batch)]
        if embeds is None:
            raise ValueError("pass a prompt, or prompt_embeds (one [L_i, E] array per image)")
        embeds = [np.asarray(e, np.float32) for e in embeds]
        width = self.config.cap_feat_dim
        bad = next((e.shape for e in embeds if e.ndim != 2 or e.shape[0] < 1 or e.shape[1] != width), None)
        if bad is not None:
            raise ValueError(f"prompt embeddings of shape {bad}: this model takes [L_i, {width}] per image")
        return [e for e in embeds for _ in range(r.num_images_per_prompt)]

    def prepare(self, r: GenerationRequest) -> Prepared:
        scale = float(r.guidance_scale)
        truncation, renorm = getattr(self, "_cfg_options", (1.0, 0.0))
        caps = self._captions(r.prompt, r.prompt_embeds, r)
        cfg = scale > 0
        self.check_cfg(cfg)
        batch = len(caps)
        self.check_batch(batch)
        negative = []
        if cfg:
            neg_prompt = r.negative_prompt if r.negative_prompt is not None else ""
            if r.negative_prompt_embeds is not None:
                negative = self._captions(None, r.negative_prompt_embeds, r)
            else:
                negative = self._captions(neg_prompt, None, r, batch=batch)
            if len(negative) != batch:
                raise ValueError(f"{len(negative)} negative prompts for {batch} images")
        h, w = self.latent_size(r.height, r.width)
        shape = (batch, self.config.in_channels, h, w)
        if r.latents is not None and np.shape(r.latents) != shape:
            raise ValueError(f"latents have shape {np.shape(r.latents)}; this request needs {shape}")
        noise = (
            latent_ops.initial_noise(r.seed, shape)
            if r.latents is None
            else np.asarray(r.latents, np.float32)
        )
        # Positive and negative captions share one padded length (each keeps its own under the mask).
        cap = caption_inputs(caps + negative)
        rows = np.concatenate([noise, noise]) if cfg else noise
        img = image_inputs(rows, cap.pop("cap_lengths"), self.config.patch_size)
        if cap["cap_mask"] is None:
            cap.pop("cap_mask")
        context = {**cap, "img_ids": img["img_ids"], "x_pad": img["x_pad"]}
        if cfg:
            per_row = [k for k in context if k != "x_pad"]
            for k in per_row:
                pos, neg = context[k][:batch], context[k][batch:]
                context[k] = self.branches(neg, pos)
        tokens = img["hidden_states"][:batch]
        schedule = self.sampler.schedule(r.num_inference_steps, image_seq_len=(h // 2) * (w // 2))
        scales = ()
        if cfg:
            t_norm = (1000.0 - np.asarray(schedule.timesteps, np.float32)) / 1000.0
            scales = tuple(1.0 if tn > truncation else 1.0 + scale for tn in t_norm.tolist())
        inputs = DenoiseInputs(
            tokens=tokens,
            context=context,
            schedule=schedule,
            steps=r.num_inference_steps,
            cfg=cfg,
            scale=1.0 + scale,
            scales=scales,
            renorm=renorm if cfg else 0.0,
            grid=(h // self.config.patch_size, w // self.config.patch_size),
        )
        if self.parallel.pipefusion > 1 and cfg:
            if renorm:
                raise ValueError(
                    "cfg_normalization caps each image's guided norm over all its tokens, which PipeFusion's "
                    "patches do not see together: leave it off, or use ulysses/ring/cfg parallelism"
                )
            if len(set(scales)) > 1:
                raise ValueError(
                    f"cfg_truncation={truncation} changes the guidance within the run, and PipeFusion takes "
                    "one guidance scale per run: leave it at 1, or use ulysses/ring/cfg parallelism"
                )
        c, p = self.config.in_channels, self.config.patch_size
        return Prepared(inputs, lambda t: np.asarray(unpack(np.asarray(t), c, h, w, p)))
