"""Text-to-image sampling with a Qwen-Image transformer on a mesh (diffusers' ``QwenImagePipeline`` call,
``pipelines/qwenimage/pipeline_qwenimage.py``).

What is Qwen-Image's own (the loop, decoding and output types are
:class:`~jaxdit.pipelines.base.DiffusionPipeline`'s):

- conditioning: Qwen2.5-VL's last hidden state of the templated prompt (``text_encoders/qwen_image_prompt``)
  and a mask of each prompt's real tokens; prompts keep their own lengths, so a negative prompt of another
  length is padded to the longer one with masked keys (exact: padded text is no key of any attention, and
  each text token's RoPE position does not depend on the length);
- true classifier-free guidance when ``true_cfg_scale > 1`` and a negative prompt is given, the combined
  prediction rescaled per token to the conditional one's norm (:func:`norm_preserving_guidance`);
- latents ``[B, C, H/f, W/f]`` packed into 2x2-patch tokens (as FLUX.1), RoPE ids centred on the image
  (``models/qwen_image_config.rope_positions``);
- flow-matching Euler over ``sigmas`` (default ``linspace(1, 1/N, N)``) with the folder scheduler's dynamic
  shift (``mu`` by the image token count) and terminal stretch;
- decoding: the VAE (``AutoencoderKLQwenImage``, read by the Wan VAE) on one frame, the latents first
  de-normalised by the VAE's ``latents_mean`` / ``latents_std``.

The initial noise comes from the seed alone (host, fp32), so the same seed gives the same picture on every
mesh. ``encode(prompts, max_sequence_length=) -> (embeds [B, T, C], mask [B, T])`` and ``decode(latents
[B, C, h, w]) -> images [B, H, W, 3] in [-1, 1]`` plug in as callables.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from converters.lora import qwen_image as _lora_layouts  # noqa: F401  registers them: pipe.load_lora reads
from converters.qwen_image import CHECKPOINTS
from jaxdit.loading.qwen_image_encoder import check_text_encoder_folder, load_qwen_image_prompt_encoder
from jaxdit.loading.wan import load_wan_vae
from jaxdit.mesh import DeviceMesh, ParallelConfig
from jaxdit.models import qwen_image
from jaxdit.models.qwen_image_config import QwenImageConfig, rope_positions
from jaxdit.parallel.kernels import check_kernel_options, with_backend
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.assemble import as_dtype, check_transformer, load_model
from jaxdit.pipelines.base import DiffusionPipeline, GenerationOutput, Prepared
from jaxdit.pipelines.denoiser import DenoiseInputs, TokenHooks
from jaxdit.pipelines.model_folder import FolderClass, open_diffusers_folder
from jaxdit.pipelines.pipefusion.qwen_image import PipeFusionQwenImage, QwenImagePatches
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.samplers import flow_match_euler as euler
from jaxdit.samplers.sampler import EulerSampler
from jaxdit.text_encoders.qwen_image_prompt import MAX_PROMPT_TOKENS

__all__ = ["DEFAULT_SCHEDULER", "FOLDER_CLASSES", "QwenImagePipeline", "norm_preserving_guidance"]

#: The diffusers pipeline class this module runs from a downloaded folder.
FOLDER_CLASSES = {
    "QwenImagePipeline": FolderClass(
        "qwen-image",
        "qwen-image",
        ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
        classes={
            "transformer": ("QwenImageTransformer2DModel",),
            "vae": ("AutoencoderKLQwenImage",),
            "text_encoder": ("Qwen2_5_VLForConditionalGeneration",),
        },
    )
}

#: Qwen-Image's scheduler (its ``scheduler_config.json``): exponential dynamic shift from 0.5 at 256 image
#: tokens to 0.9 at 8192, stretched to end at sigma 0.02.
DEFAULT_SCHEDULER = euler.FlowMatchEulerConfig(
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
)


def norm_preserving_guidance(uncond: jax.Array, cond: jax.Array, scale: jax.Array) -> jax.Array:
    """Qwen-Image's true CFG: ``uncond + scale * (cond - uncond)`` rescaled, per token, to the norm of the
    conditional prediction (over its features), in fp32. A token whose combination is zero stays zero
    (padded tokens of the mesh layout, never read)."""
    u, c = uncond.astype(jnp.float32), cond.astype(jnp.float32)
    combined = u + scale * (c - u)
    cond_norm = jnp.linalg.norm(c, axis=-1, keepdims=True)
    norm = jnp.linalg.norm(combined, axis=-1, keepdims=True)
    ratio = jnp.where(norm > 0, cond_norm / jnp.where(norm > 0, norm, 1.0), 0.0)
    return (combined * ratio).astype(cond.dtype)


#: How Qwen-Image's latent tokens meet its transformer: as they are, with its own CFG rule.
HOOKS = TokenHooks(guidance=norm_preserving_guidance)


class QwenImagePipeline(DiffusionPipeline):
    """A Qwen-Image transformer on a mesh plus a sampler, optional prompt encoder and decoder.

    Args:
      model: a ``QwenImageTransformer`` placed for ``mesh`` (``jaxdit.loading.load_params``), or on a mesh
        with ``pipefusion > 1`` its stage layout (``PipeFusionQwenImage``).
      mesh: from ``ParallelConfig.make_mesh``.
      scheduler: flow-matching Euler settings (default: Qwen-Image's).
      encode / decode: the prompt encoder and the VAE decoder (see the module docstring).
      latent_channels / vae_scale_factor: latent shape = [channels, H / f, W / f] (Qwen-Image: 16, 8).
      kernel: attention kernel options; compiler_options: XLA options for the compiled step.
    """

    cfg_hint = "pass a negative prompt and true_cfg_scale > 1"
    # diffusers' default: default_sample_size 128 x the VAE's 8 (the model card draws at 1328x1328).
    default_size = (1024, 1024)
    checkpoints = CHECKPOINTS
    staged_model = PipeFusionQwenImage
    pipefusion_caches = frozenset({"magcache", "taylorseer"})  # host-planned: pipelines/pipefusion/cache.py

    def __init__(
        self,
        model: Any,
        mesh: Mesh,
        *,
        scheduler: euler.FlowMatchEulerConfig | None = None,
        encode: Callable[..., tuple[np.ndarray, np.ndarray]] | None = None,
        decode: Callable[[np.ndarray], np.ndarray] | None = None,
        latent_channels: int | None = None,
        vae_scale_factor: int = 8,
        kernel: dict[str, Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(mesh, encode=encode, decode=decode)
        self.model = model
        self.config: QwenImageConfig = model.config
        self.scheduler = scheduler or DEFAULT_SCHEDULER
        self.sampler = EulerSampler(self.scheduler)
        self.latent_channels = latent_channels or model.config.in_channels // 4
        self.vae_scale_factor = vae_scale_factor
        # Under PipeFusion ``model`` is the stage layout (PipeFusionQwenImage).
        self.forward = self.plain_forward(qwen_image.sharded, model, kernel)
        self.denoiser = self.denoiser_for(
            model,
            self.sampler,
            patches=QwenImagePatches,
            kernel=kernel,
            compiler_options=compiler_options,
            token_hooks=HOOKS,
            guidance=norm_preserving_guidance,
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
        text_encoder: str | os.PathLike[str] | None = None,
        fp8: str | None = None,
        offload_encoders: bool = False,
    ) -> QwenImagePipeline:
        """A downloaded Qwen-Image diffusers folder (``model_index.json``, ``transformer/``, ``vae/``,
        ``text_encoder/``, ``tokenizer/``, ``scheduler/``) on the mesh of ``parallel``.

        The transformer is sharded over the mesh (stage slots on a pipefusion mesh); the Qwen2.5-VL encoder
        runs on ``encoder_device`` (default: the first local device); the VAE decodes row-parallel over the
        mesh. The transformer's heads and key table and the text encoder's kind are checked before any
        weight is read. ``text_encoder``: a single-file Qwen2.5-VL (ComfyUI's ``qwen_2.5_vl_7b*.safetensors``)
        instead of the folder's ``text_encoder/``. ``fp8``: ``"weight"`` or ``"matmul"``: the transformer
        blocks' linear layers in FP8 (``jaxdit.models.fp8``; plain meshes, not PipeFusion).
        ``offload_encoders``: the encoder's weights wait in host memory between prompts.
        """
        kernel = with_backend(kernel, attention_backend)
        check_kernel_options(kernel)
        folder = open_diffusers_folder(Path(path), FOLDER_CLASSES)
        where = DeviceMesh.of(parallel)
        mesh = where.mesh
        check_transformer(folder["transformer"], where, CHECKPOINTS)
        check_text_encoder_folder(folder.root, text_encoder)
        dtype = as_dtype(dtype)
        encoder = load_qwen_image_prompt_encoder(
            folder.root,
            device=encoder_device,
            dtype=dtype,
            text_encoder=text_encoder,
            offload=offload_encoders,
        )
        vae = load_wan_vae(folder["vae"], dtype=dtype, compiler_options=compiler_options)
        model = load_model(
            folder["transformer"], where, dtype, CHECKPOINTS, staged=PipeFusionQwenImage, fp8=fp8
        )

        def decode(z: np.ndarray) -> np.ndarray:
            frames = vae.decode_latents(np.asarray(z, np.float32)[:, :, None], mesh=mesh)  # [B, 3, 1, H, W]
            return np.asarray(frames[:, :, 0], np.float32).transpose(0, 2, 3, 1)

        return cls(
            model,
            where,
            scheduler=euler.FlowMatchEulerConfig.from_diffusers(folder.scheduler_config),
            encode=encoder,
            decode=decode,
            latent_channels=model.config.in_channels // 4,
            vae_scale_factor=vae.config.spatial_factor,
            kernel=kernel,
            compiler_options=compiler_options,
        )

    # ------------------------------------------------------------------ call
    def __call__(
        self,
        prompt: str | Sequence[str] | None = None,
        *,
        negative_prompt: str | Sequence[str] | None = None,
        true_cfg_scale: float = 4.0,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        sigmas: Sequence[float] | None = None,
        num_images_per_prompt: int = 1,
        seed: int = 0,
        latents: np.ndarray | None = None,
        prompt_embeds: np.ndarray | None = None,
        prompt_embeds_mask: np.ndarray | None = None,
        negative_prompt_embeds: np.ndarray | None = None,
        negative_prompt_embeds_mask: np.ndarray | None = None,
        max_sequence_length: int = MAX_PROMPT_TOKENS,
        output_type: str = "np",
        progress: bool = True,
        callback: Callable[[int, int], bool | None] | None = None,
        num_pipeline_patch: int | None = None,
        warmup_steps: int | None = None,
        cache: Any = None,
    ) -> GenerationOutput:
        """Generate images, as diffusers' ``QwenImagePipeline``: ``true_cfg_scale`` > 1 with a negative
        prompt (or negative embeddings) runs true CFG, rescaled per token; ``sigmas``: the unshifted
        schedule (one per step; default ``linspace(1, 1/N, N)``); ``latents``: initial noise [B, C, H/f,
        W/f] instead of the seed's (``generator`` in diffusers); ``prompt_embeds`` [B, T, C] with
        ``prompt_embeds_mask`` [B, T] (None: every token real); ``max_sequence_length``: text tokens kept
        (at most 1024). PipeFusion (a mesh with pipefusion > 1): ``num_pipeline_patch``, ``warmup_steps``.
        ``output_type``: np, pil or latent. ``sigmas`` and the masks are Qwen-Image's own arguments: they
        travel in the request's ``family_arguments``."""
        return self.generate(GenerationRequest.of(**{k: v for k, v in locals().items() if k != "self"}))

    # ------------------------------------------------------------------ family hook
    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        f = self.vae_scale_factor
        if height % (2 * f) or width % (2 * f):
            raise ValueError(
                f"height and width must be multiples of {2 * f} (VAE factor {f} x 2x2 patches); got {height}x{width}"
            )
        return height // f, width // f

    def prepare(self, r: GenerationRequest) -> Prepared:
        if r.max_sequence_length is not None and r.max_sequence_length > MAX_PROMPT_TOKENS:
            raise ValueError(
                f"max_sequence_length is at most {MAX_PROMPT_TOKENS} for Qwen-Image, got {r.max_sequence_length}"
            )
        h, w = self.latent_size(r.height, r.width)
        own = r.family_arguments
        txt, mask = self._conditioning(r.prompt, r.prompt_embeds, own.get("prompt_embeds_mask"), r)
        has_negative = r.negative_prompt is not None or r.negative_prompt_embeds is not None
        cfg = has_negative and r.true_cfg_scale > 1.0
        self.check_cfg(cfg)
        batch = len(txt)
        if cfg:
            neg, neg_mask = self._conditioning(
                r.negative_prompt, r.negative_prompt_embeds, own.get("negative_prompt_embeds_mask"), r, batch
            )
            if len(neg) != batch or neg.shape[2] != txt.shape[2]:
                raise ValueError(
                    f"negative prompt embeddings {neg.shape} do not match the prompt's {txt.shape}"
                )
            length = max(txt.shape[1], neg.shape[1])  # each keeps its own real tokens under the mask
            (txt, mask), (neg, neg_mask) = _pad(txt, mask, length), _pad(neg, neg_mask, length)
            txt, mask = self.branches(neg, txt), self.branches(neg_mask, mask)
        self.check_batch(batch)
        shape = (batch, self.latent_channels, h, w)
        if r.latents is not None and np.shape(r.latents) != shape:
            raise ValueError(f"latents have shape {np.shape(r.latents)}; this request needs {shape}")
        noise = latent_ops.initial_noise(r.seed, shape) if r.latents is None else np.asarray(r.latents)
        tokens = latent_ops.pack(np.asarray(noise, np.float32))
        txt_ids, img_ids = rope_positions(txt.shape[1], h // 2, w // 2)
        context = {
            "encoder_hidden_states": txt,
            "encoder_hidden_states_mask": mask.astype(bool),
            "txt_ids": txt_ids.astype(np.float32),
            "img_ids": img_ids.astype(np.float32),
        }
        inputs = DenoiseInputs(
            tokens=tokens,
            context=context,
            schedule=self.schedule(r.num_inference_steps, tokens.shape[1], own.get("sigmas")),
            steps=r.num_inference_steps,
            cfg=cfg,
            scale=r.true_cfg_scale,
            grid=(h // 2, w // 2),
        )
        return Prepared(inputs, lambda t: latent_ops.unpack(t, h, w))

    def schedule(self, steps: int, image_tokens: int, sigmas: Any = None) -> euler.FlowMatchEulerSchedule:
        """diffusers' Qwen-Image schedule: ``sigmas`` (default ``linspace(1, 1/N, N)``) shifted by ``mu``
        of the image token count (the scheduler config's line), then stretched to its terminal sigma."""
        c = self.scheduler
        if sigmas is not None and len(sigmas) != steps:
            raise ValueError(f"{len(sigmas)} sigmas for {steps} steps: give one per step")
        mu = euler.dynamic_shift_mu(
            image_tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift
        )
        given = euler.linear_sigmas(steps) if sigmas is None else np.asarray(sigmas, np.float64)
        return euler.set_timesteps(c, sigmas=given, mu=mu if c.use_dynamic_shifting else None)

    def _conditioning(
        self, prompt, embeds, mask, r: GenerationRequest, batch: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings [B, T, C] fp32, mask [B, T] bool) from a prompt or given embeddings."""
        if prompt is not None:
            if embeds is not None:
                raise ValueError("pass either a prompt or prompt embeddings, not both")
            embeds, mask = self.encode_prompts(prompt, r, batch=batch)
        else:
            if embeds is None:
                raise ValueError("pass a prompt, or prompt_embeds [B, T, C] (with prompt_embeds_mask [B, T])")
            embeds, mask = self.repeat_per_prompt(embeds, r), self.repeat_per_prompt(mask, r)
        embeds = np.asarray(embeds, np.float32)
        if embeds.ndim != 3 or embeds.shape[2] != self.config.joint_attention_dim:
            raise ValueError(
                f"prompt embeddings have shape {embeds.shape}; this model takes [B, T, "
                f"{self.config.joint_attention_dim}]"
            )
        mask = np.ones(embeds.shape[:2], bool) if mask is None else np.asarray(mask).astype(bool)
        if mask.shape != embeds.shape[:2]:
            raise ValueError(f"the prompt mask has shape {mask.shape}; its embeddings are {embeds.shape[:2]}")
        if r.max_sequence_length is not None:
            embeds, mask = embeds[:, : r.max_sequence_length], mask[:, : r.max_sequence_length]
        return embeds, mask


def _pad(embeds: np.ndarray, mask: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad the text to ``length`` tokens: zero features, masked."""
    extra = length - embeds.shape[1]
    return np.pad(embeds, ((0, 0), (0, extra), (0, 0))), np.pad(mask, ((0, 0), (0, extra)))
