"""FLUX.2 [klein] on a mesh: diffusers' ``Flux2KleinPipeline`` call (``pipelines/flux2/
pipeline_flux2_klein.py``), text-to-image and multi-reference editing.

What is FLUX.2's own (the loop, decoding and output types are
:class:`~jaxdit.pipelines.base.DiffusionPipeline`'s):

- conditioning: three stacked Qwen3 hidden states of the templated prompt, padded to
  ``max_sequence_length`` (``text_encoders/flux2_prompt.py``), with 4-axis text ids (0, 0, 0, j);
- latents: the noise is drawn in the packed latent grid [B, 128, H/16, W/16] (32 VAE channels x 2 x 2
  patches; the project's convention: ``default_rng(seed).standard_normal`` of that shape) and packed
  row-major into tokens with ids (0, row, col, 0);
- the schedule: ``linspace(1, 1/N, N)`` shifted with diffusers' ``compute_empirical_mu`` of the image
  token count AND the step count (:func:`empirical_mu`), by the folder scheduler's rule;
- guidance: a distilled klein (``is_distilled`` in ``model_index.json``) runs one branch whatever the
  scale; the base model runs classifier-free guidance ``neg + g (pos - neg)`` for g > 1 with the empty
  prompt as the negative;
- references: each picture sized by ``pipelines/flux2_references.py``, VAE-encoded (posterior mean,
  patchified, batch-normalised), packed and joined along the sequence after the denoised tokens with
  time ids 10, 20, ... (``models.flux2_config.reference_ids``); they are the forward's REFERENCE token
  group, never denoised, on every strategy.

``output_type="latent"`` returns what diffusers returns: the de-normalised, un-patchified VAE latents
[B, 32, H/8, W/8] (a pipeline without a VAE returns the normalised grid [B, 128, H/16, W/16]).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from converters.flux2 import CHECKPOINTS
from jaxdit.loading.decoder_lm import load_decoder_lm
from jaxdit.loading.flux2_vae import load_flux2_vae
from jaxdit.mesh import DeviceMesh, ParallelConfig
from jaxdit.models import flux2
from jaxdit.models.flux2_config import Flux2Config, image_ids, reference_ids, text_ids
from jaxdit.parallel.kernels import check_kernel_options, with_backend
from jaxdit.pipelines import flux2_references as refs
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.assemble import as_dtype, check_transformer, load_model
from jaxdit.pipelines.base import DiffusionPipeline, GenerationOutput, Prepared
from jaxdit.pipelines.denoiser import DenoiseInputs
from jaxdit.pipelines.model_folder import FolderClass, open_diffusers_folder
from jaxdit.pipelines.pipefusion.flux2 import Flux2Patches, PipeFusionFlux2
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.samplers import flow_match_euler as euler
from jaxdit.samplers.sampler import EulerSampler
from jaxdit.text_encoders.decoder_lm import DecoderLMRunner
from jaxdit.text_encoders.flux2_prompt import HIDDEN_STATES, MAX_SEQUENCE_LENGTH, Flux2KleinPromptEncoder

__all__ = ["DEFAULT_SCHEDULER", "FOLDER_CLASSES", "Flux2KleinPipeline", "empirical_mu"]


def _klein_kind(index: dict) -> str:
    return "flux2-klein" if index.get("is_distilled", False) else "flux2-klein-base"


FOLDER_CLASSES = {
    "Flux2KleinPipeline": FolderClass(
        "flux2",
        "flux2-klein",
        ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
        classes={"transformer": ("Flux2Transformer2DModel",), "vae": ("AutoencoderKLFlux2",)},
        variant=_klein_kind,
    )
}

#: FLUX.2's scheduler_config.json: exponential dynamic shift (mu from :func:`empirical_mu`).
DEFAULT_SCHEDULER = euler.FlowMatchEulerConfig(shift=3.0, use_dynamic_shifting=True)


def empirical_mu(image_tokens: int, steps: int) -> float:
    """diffusers' FLUX.2 ``compute_empirical_mu``: above 4300 image tokens a line in the token count;
    below, the line through its values at 10 and 200 steps, evaluated at ``steps``."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    at_200 = a2 * image_tokens + b2
    if image_tokens > 4300:
        return float(at_200)
    at_10 = a1 * image_tokens + b1
    slope = (at_200 - at_10) / 190.0
    return float(slope * steps + at_200 - 200.0 * slope)


class Flux2KleinPipeline(DiffusionPipeline):
    """A FLUX.2 transformer (klein: no guidance embedding) on a mesh plus the Euler sampler, optional
    prompt encoder, VAE encoder (references) and decoder.

    ``encode(prompts, max_sequence_length=)`` -> [B, L, joint_attention_dim];
    ``encode_image(pixels [1, 3, H, W])`` -> (tokens [1, N, 128], rows, cols);
    ``decode(latents [B, 32, H/8, W/8])`` -> images [B, H, W, 3] in [-1, 1];
    ``to_vae_latents(grid [B, 128, h, w])`` -> [B, 32, 2h, 2w] (de-normalised, un-patchified).
    """

    cfg_hint = "use a klein base model (not distilled) with guidance_scale > 1"
    default_size = (1024, 1024)  # diffusers: default_sample_size 128 x the VAE's 8
    checkpoints = CHECKPOINTS
    staged_model = PipeFusionFlux2
    pipefusion_caches = frozenset({"magcache", "taylorseer"})  # host-planned: pipelines/pipefusion/cache.py
    folder_classes = FOLDER_CLASSES
    #: The text encoder's hidden states the prompt features stack.
    hidden_states = HIDDEN_STATES
    #: Whether the transformer embeds a guidance scale (dev) or not (klein), and what a wrong one is told.
    embeds_guidance = False
    wrong_transformer = (
        "this FLUX.2 transformer embeds a guidance scale (FLUX.2 [dev]): run it with Flux2Pipeline; "
        "Flux2KleinPipeline runs klein transformers (guidance_embeds=False)"
    )

    def __init__(
        self,
        model: Any,
        mesh: Mesh,
        *,
        scheduler: euler.FlowMatchEulerConfig | None = None,
        is_distilled: bool = False,
        encode: Callable[..., np.ndarray] | None = None,
        encode_image: Callable[[np.ndarray], tuple[np.ndarray, int, int]] | None = None,
        decode: Callable[[np.ndarray], np.ndarray] | None = None,
        to_vae_latents: Callable[[np.ndarray], np.ndarray] | None = None,
        vae_scale_factor: int = 8,
        kernel: dict[str, Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(mesh, encode=encode, decode=decode)
        self.model = model
        self.config: Flux2Config = model.config
        if bool(self.config.guidance_embeds) != self.embeds_guidance:
            raise ValueError(self.wrong_transformer)
        self.scheduler = scheduler or DEFAULT_SCHEDULER
        self.sampler = EulerSampler(self.scheduler)
        self.is_distilled = bool(is_distilled)
        self.encode_image = encode_image
        self.to_vae_latents = to_vae_latents
        self.vae_scale_factor = vae_scale_factor
        self.forward = self.plain_forward(flux2.sharded, model, kernel)
        # Under PipeFusion ``model`` is the stage layout (PipeFusionFlux2) and there is no plain forward.
        self.denoiser = self.denoiser_for(
            model, self.sampler, patches=Flux2Patches, kernel=kernel, compiler_options=compiler_options
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
        offload_encoders: bool = False,
        encoder_on_mesh: bool = False,
    ) -> Flux2KleinPipeline:
        """A diffusers ``Flux2KleinPipeline`` folder (distilled or base; dev's ``Flux2Pipeline`` for that
        class) on the mesh of ``parallel``: the transformer sharded over it, the VAE encoding and decoding
        row-parallel over the mesh. Heads and the key table are checked before anything is read.

        The text encoder (Qwen3 for klein, Mistral3 for dev) runs once per prompt, before the loop: by
        default on the first device; ``offload_encoders``: there too, its weights waiting in host memory
        between prompts (the device holds none of it while the transformer runs); ``encoder_on_mesh``:
        sharded over the mesh instead, heads and MLP split over ``tensor`` (the decoder-LM rule table) and
        the prompt's tokens over the sequence axes."""
        if offload_encoders and encoder_on_mesh:
            raise ValueError(
                "offload_encoders keeps the text encoder on one device; encoder_on_mesh shards it"
            )
        kernel = with_backend(kernel, attention_backend)
        check_kernel_options(kernel)
        folder = open_diffusers_folder(Path(path), cls.folder_classes)
        where = DeviceMesh.of(parallel)
        mesh = where.mesh
        check_transformer(folder["transformer"], where, CHECKPOINTS)
        dtype = as_dtype(dtype)
        # Only the layers up to the deepest one stacked are read (the later ones never run); one more
        # is kept so that one stays an intermediate output (a decoder's last is its normed output).
        layers = max(cls.hidden_states) + 1
        if encoder_on_mesh:
            lm = load_decoder_lm(folder["text_encoder"], mesh=mesh, dtype=dtype, layers=layers)
            runner = DecoderLMRunner(lm, mesh)
        else:
            lm = load_decoder_lm(folder["text_encoder"], dtype=dtype, layers=layers)
            runner = DecoderLMRunner(lm, offload=offload_encoders)
        encoder = cls.prompt_encoder(Path(folder["tokenizer"]), runner)
        vae = load_flux2_vae(folder["vae"], dtype=dtype)
        model = load_model(folder["transformer"], where, dtype, CHECKPOINTS, staged=PipeFusionFlux2)
        mean, std = vae.mean[None, :, None, None], vae.std[None, :, None, None]

        def to_vae_latents(grid: np.ndarray) -> np.ndarray:
            z = np.asarray(grid, np.float32) * std + mean
            b, c, h, w = z.shape
            z = z.reshape(b, c // 4, 2, 2, h, w).transpose(0, 1, 4, 2, 5, 3)
            return z.reshape(b, c // 4, 2 * h, 2 * w)

        def decode(z: np.ndarray) -> np.ndarray:
            pixels = np.asarray(vae.vae.decode(np.asarray(z, vae.vae.dtype), mesh), np.float32)
            pixels = pixels.transpose(0, 2, 3, 1)
            return np.where(np.isfinite(pixels), np.clip(pixels, -1.0, 1.0), np.nan)

        def encode_image(pixels: np.ndarray) -> tuple[np.ndarray, int, int]:
            tokens, rows, cols = vae.encode_tokens(np.asarray(pixels, vae.vae.dtype), mesh)
            return np.asarray(tokens, np.float32), rows, cols

        return cls(
            model,
            where,
            scheduler=euler.FlowMatchEulerConfig.from_diffusers(folder.scheduler_config),
            is_distilled=cls.one_branch(folder.index),
            encode=encoder,
            encode_image=encode_image,
            decode=decode,
            to_vae_latents=to_vae_latents,
            vae_scale_factor=2 ** (len(vae.vae.config.block_out_channels) - 1),
            kernel=kernel,
            compiler_options=compiler_options,
        )

    @classmethod
    def prompt_encoder(cls, tokenizer: Path, runner: DecoderLMRunner) -> Callable[..., np.ndarray]:
        """The folder's prompt path: klein's Qwen3 chat turn (the tokenizer's own template)."""
        from transformers import AutoTokenizer

        return Flux2KleinPromptEncoder(AutoTokenizer.from_pretrained(tokenizer), runner, cls.hidden_states)

    @classmethod
    def one_branch(cls, index: dict) -> bool:
        """Whether the folder's model runs without CFG: a distilled klein (``is_distilled``)."""
        return bool(index.get("is_distilled", False))

    def __call__(
        self,
        image: Any = None,
        prompt: str | Sequence[str] | None = None,
        *,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        sigmas: Sequence[float] | None = None,
        guidance_scale: float = 4.0,
        num_images_per_prompt: int = 1,
        seed: int = 0,
        latents: np.ndarray | None = None,
        prompt_embeds: np.ndarray | None = None,
        negative_prompt_embeds: np.ndarray | None = None,
        output_type: str = "np",
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        progress: bool = True,
        callback: Callable[[int, int], bool | None] | None = None,
        cache: Any = None,
        num_pipeline_patch: int | None = None,
        warmup_steps: int | None = None,
    ) -> GenerationOutput:
        """Generate (or, with ``image``: one picture or a list, edit) as diffusers' ``Flux2KleinPipeline``.
        ``guidance_scale`` > 1 runs CFG against the empty prompt on a base model and is ignored by a
        distilled one; ``latents``: initial noise [B, 128, H/16, W/16] instead of the seed's;
        ``prompt_embeds`` [B, L, joint_attention_dim]; height / width default to the first reference
        picture's size, else 1024. ``sigmas`` is this family's own argument (``family_arguments``). PipeFusion
        (a mesh with pipefusion > 1): ``num_pipeline_patch``, ``warmup_steps``."""
        return self.generate(GenerationRequest.of(**{k: v for k, v in locals().items() if k != "self"}))

    def generate(self, request: GenerationRequest) -> GenerationOutput:
        if request.image is not None and (request.height is None or request.width is None):
            first = refs.as_pictures(request.image)[0]
            w, h = refs.reference_size(*first.size, 2 * self.vae_scale_factor)
            request = request.replace(height=request.height or h, width=request.width or w)
        return super().generate(request)

    # ------------------------------------------------------------------ family hook
    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of the packed latent grid."""
        f = 2 * self.vae_scale_factor
        if height % f or width % f:
            raise ValueError(
                f"height and width must be multiples of {f} (VAE factor {f // 2} x 2x2 patches); "
                f"got {height}x{width}"
            )
        return height // f, width // f

    def _text(self, prompt, embeds, r: GenerationRequest, batch: int | None = None) -> np.ndarray:
        if prompt is not None:
            embeds = self.encode_prompts(prompt, r, batch=batch)
        elif embeds is None:
            raise ValueError("pass a prompt, or prompt_embeds [B, L, joint_attention_dim]")
        else:
            embeds = self.repeat_per_prompt(embeds, r)
            if batch is not None and len(embeds) == 1:
                embeds = np.repeat(embeds, batch, axis=0)
        embeds = np.asarray(embeds, np.float32)
        width = self.config.joint_attention_dim
        if embeds.ndim != 3 or embeds.shape[2] != width or embeds.shape[1] < 1:
            raise ValueError(f"prompt embeddings have shape {embeds.shape}; this model takes [B, L, {width}]")
        return embeds

    def prepare(self, r: GenerationRequest) -> Prepared:
        if r.prompt is None and r.prompt_embeds is None:
            raise ValueError("pass a prompt, or prompt_embeds [B, L, joint_attention_dim]")
        rows, cols = self.latent_size(r.height, r.width)
        txt = self._text(r.prompt, r.prompt_embeds, r)
        batch = len(txt)
        cfg = r.guidance_scale > 1.0 and not self.is_distilled
        self.check_cfg(cfg)
        self.check_batch(batch)
        if cfg:
            neg = (
                self._text("", None, r, batch=batch)
                if r.negative_prompt_embeds is None
                else self._text(None, r.negative_prompt_embeds, r, batch=batch)
            )
            if neg.shape != txt.shape:
                raise ValueError(
                    f"negative prompt embeddings {neg.shape} do not match the prompt's {txt.shape}"
                )
            txt = self.branches(neg, txt)
        channels = self.config.in_channels
        shape = (batch, channels, rows, cols)
        if r.latents is not None and np.shape(r.latents) != shape:
            raise ValueError(f"latents have shape {np.shape(r.latents)}; this request needs {shape}")
        noise = latent_ops.initial_noise(r.seed, shape) if r.latents is None else np.asarray(r.latents)
        tokens = np.asarray(noise, np.float32).reshape(batch, channels, rows * cols).transpose(0, 2, 1)
        context = {
            "encoder_hidden_states": txt,
            "txt_ids": text_ids(txt.shape[1]).astype(np.float32),
            "img_ids": image_ids(rows, cols).astype(np.float32),
        }
        if r.image is not None:
            context.update(self._references(r.image, len(txt)))
        steps = r.num_inference_steps
        given = r.family_arguments.get("sigmas")
        if given is not None and len(given) != steps:
            raise ValueError(f"{len(given)} sigmas for {steps} steps: give one per step")
        sigmas = euler.linear_sigmas(steps) if given is None else np.asarray(given, np.float64)
        mu = empirical_mu(rows * cols, steps) if self.scheduler.use_dynamic_shifting else None
        inputs = DenoiseInputs(
            tokens=tokens,
            context=context,
            schedule=euler.set_timesteps(self.scheduler, sigmas=sigmas, mu=mu),
            steps=steps,
            cfg=cfg,
            scale=float(r.guidance_scale),
            grid=(rows, cols),
        )

        def to_latents(t: np.ndarray) -> np.ndarray:
            grid = np.asarray(t, np.float32).transpose(0, 2, 1).reshape(batch, channels, rows, cols)
            return grid if self.to_vae_latents is None else self.to_vae_latents(grid)

        return Prepared(inputs, to_latents)

    def _references(self, image: Any, rows: int) -> dict[str, np.ndarray]:
        """The reference pictures as the forward's REFERENCE group, the same for every batch row."""
        if self.encode_image is None:
            raise ValueError("this pipeline has no VAE encoder: it cannot read reference images")
        tokens, grids = [], []
        for picture in refs.as_pictures(image):
            pixels = refs.reference_pixels(picture, 2 * self.vae_scale_factor)
            t, h, w = self.encode_image(pixels)
            tokens.append(np.asarray(t, np.float32)[0])
            grids.append((h, w))
        joined = np.concatenate(tokens, axis=0)[None]
        return {
            "reference_hidden_states": np.repeat(joined, rows, axis=0),
            "reference_ids": reference_ids(grids).astype(np.float32),
        }
