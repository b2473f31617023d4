"""Text-to-video and image-to-video sampling with a Wan transformer (Wan 2.1; Wan 2.2 A14B and TI2V-5B) on
a mesh.

Mirrors diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline`` call (pipelines/wan/pipeline_wan.py and
pipeline_wan_i2v.py, diffusers 0.42.1): prompt or prompt embeddings, a negative prompt for
classifier-free guidance ``u + g (c - u)`` (on when ``guidance_scale > 1``), height, width, num_frames
(4n + 1), num_inference_steps, a seed, output_type; the sampler is UniPC on flow sigmas
(:mod:`jaxdit.samplers.unipc`, diffusers' ``UniPCMultistepScheduler(prediction_type="flow_prediction",
use_flow_sigmas=True, flow_shift=...)``), and the devices come from a ``ParallelConfig`` mesh.

Variants, as diffusers' pipelines carry them (the folder says which: ``jaxdit.pipelines.wan_folder``):

- Wan 2.1 T2V; Wan 2.1 I2V: the CLIP image features and the condition latent (4 mask channels, then the
  VAE latent of the first frame) that the transformer reads beside the noise (``wan_image.py``).
- Wan 2.2 A14B (T2V, I2V): two experts of one shape, ``transformer`` (high noise) while the timestep
  t >= ``boundary_ratio`` x 1000 and ``transformer_2`` (low noise) after, each with its guidance scale
  (``guidance_scale`` / ``guidance_scale_2``, the second defaulting to the first). One compiled step
  serves both (``wan_experts.py``: the step takes the parameters as an argument; where the idle expert
  waits is a choice). I2V-A14B reads the condition channels without CLIP features.
- Wan 2.2 TI2V-5B (``expand_timesteps``): 48 latent channels from the Wan 2.2 VAE (16x spatial). Given a
  first frame, its normalised latent replaces the first latent frame of the model's input at every step
  and of the result (a token hook inside the step: no host round trip), and the first frame's tokens see
  timestep 0 (the forward's ``timestep_mask``: per-token modulation without per-token embeddings).
  Without an image it is plain text-to-video (every token sees t, Wan 2.1's program).

Data layout. The latent [B, C, F', H/s, W/s] (F' = (F - 1) / 4 + 1) is patchified into video tokens
[B, N, C pt ph pw] once, on the host, padded to the mesh's shard-major token layout, and placed with
requests over ``data`` and tokens over (``ring``, ``ulysses``) -- logical axes ("request", "seq", None),
as FLUX's latents. The tokens and the UniPC state stay in that layout for the whole loop: each denoising
step is one jitted program (sharded transformer forward, CFG's single exchange of one prediction, UniPC
update) from padded sharded tokens to padded sharded tokens, with no host round trip. Only after the last
step are the tokens gathered, unpadded and unpatchified.

Token features: Wan's patch embedding reads a token's features in (c, t, h, w) order, its head writes them in
(t, h, w, c) order; the tokens keep the input order and the step swaps each prediction's features
(``wan_token_hooks.py``, with I2V's condition channels and TI2V's first frame). Building a pipeline from
a checkpoint or a folder: ``wan_load.py``.

Padding: the padded tokens are zero patches at position (0, 0, 0); attention masks them as keys, so they
never touch a real token, and they are dropped at the end.

The initial noise comes from the seed alone (host, fp32): the same seed gives the same video on every mesh.

Encoders and the VAE plug in as callables, as in ``FluxPipeline``: ``encode(prompts) -> [B, T, 4096]`` (umT5,
zero-padded to 512 tokens as Wan does), ``decode(latents [B, C, F', h, w]) -> video [B, F, H, W, 3]`` in
[-1, 1], and for image-to-video ``encode_image(images [B, H, W, 3], num_frames, height, width) ->
(image_embeds or None, condition)``. Without them calls take ``prompt_embeds`` / ``negative_prompt_embeds``
(and ``image_embeds`` / ``condition``) and ``output_type="latent"``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from converters.wan import CHECKPOINTS
from jaxdit.lora import FusedLoras, unfuse_loras
from jaxdit.mesh import ParallelConfig
from jaxdit.models import wan
from jaxdit.models.wan_patchify import swap_features
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.base import DiffusionPipeline, GenerationOutput, Prepared, fuse_on_top
from jaxdit.pipelines.denoiser import DenoiseInputs
from jaxdit.pipelines.pipefusion.wan import PipeFusionWan, WanPatches
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.pipelines.wan_experts import HIGH_NOISE, LOW_NOISE, TwoExperts, expert_of_steps, guidance_of_steps
from jaxdit.pipelines.wan_folder import (
    FOLDER_CLASSES,
    ORIGINAL_CLIP,
    ORIGINAL_T5,
    ORIGINAL_TOKENIZER,
    ORIGINAL_VAE,
    ORIGINAL_VAE_22,
    PRESET_VARIANTS,
    WanVariant,
    check_folder,
    checkpoint_experts,
    open_folder,
    open_original_folder,
)
from jaxdit.pipelines.wan_inputs import WanInputs, check_inputs, default_flow_shift, nearest
from jaxdit.pipelines.wan_load import checkpoint_arguments, config_difference, folder_arguments
from jaxdit.pipelines.wan_token_hooks import first_frame_tokens, token_hooks, with_first_frame
from jaxdit.samplers import unipc
from jaxdit.samplers.sampler import UniPCSampler

__all__ = [
    "FOLDER_CLASSES",
    "ORIGINAL_CLIP",
    "ORIGINAL_T5",
    "ORIGINAL_TOKENIZER",
    "ORIGINAL_VAE",
    "ORIGINAL_VAE_22",
    "PRESET_VARIANTS",
    "WanInputs",
    "WanPipeline",
    "WanVariant",
    "check_folder",
    "check_inputs",
    "default_flow_shift",
    "nearest",
    "open_folder",
    "open_original_folder",
    "swap_features",
    "token_hooks",
]

Encoder = Callable[[Sequence[str]], np.ndarray]
Decoder = Callable[[np.ndarray], np.ndarray]
ImageEncoder = Callable[[np.ndarray, int, int, int], tuple[np.ndarray | None, np.ndarray]]


class WanPipeline(DiffusionPipeline):
    """A Wan transformer (or Wan 2.2's two experts) on a mesh plus UniPC, optional encoders and VAE decoder.

    Args:
      model: a ``WanTransformer`` whose parameters are placed for ``mesh`` (``jaxdit.loading.load_params``);
        with ``transformer_2``, the high-noise expert (diffusers' ``transformer``).
      mesh: from ``ParallelConfig.make_mesh``.
      transformer_2: Wan 2.2 A14B's low-noise expert, a ``WanTransformer`` of the same config (or its
        ``nnx.State``), placed for ``mesh`` or in host memory; needs ``boundary_ratio``. Under PipeFusion a
        ``PipeFusionWan`` (or its state), or a ``WanTransformer`` that is laid out in stage slots here.
      boundary_ratio: the high-noise expert runs while t >= boundary_ratio x num_train_timesteps.
      expand_timesteps: Wan 2.2 TI2V (per-token timesteps; an image replaces the first latent frame).
      offload_idle_expert: keep only the running expert on the mesh, the other in host memory
        (``jaxdit.pipelines.wan_experts``); default: both resident.
      scheduler: UniPC settings; its ``flow_shift`` is used when a call gives none (default: by resolution,
        :func:`default_flow_shift`).
      vae_scale_factor_spatial / vae_scale_factor_temporal: the VAE's (default: ``WanConfig.vae_factors``,
        8 and 4 for Wan 2.1's 16 latent channels, 16 and 4 for the Wan 2.2 VAE's 48).
      kernel: attention kernel options; compiler_options: XLA options for the compiled step.

    On a mesh with ``pipefusion > 1`` ``model`` is the PipeFusion stage layout (``PipeFusionWan``) and the
    denoiser is the PipeFusion runner, for every variant (Wan 2.2 A14B: ``transformer_2`` in the same
    layout, one PipeFusion run per expert segment of the schedule, ``pipefusion/segments.py``).
    """

    cfg_hint = "use guidance_scale > 1 with negative conditioning"
    checkpoints = CHECKPOINTS
    staged_model = PipeFusionWan
    pipefusion_caches = frozenset({"magcache", "taylorseer"})  # host-planned: pipelines/pipefusion/cache.py

    def __init__(
        self,
        model: wan.WanTransformer,
        mesh: Mesh,
        *,
        transformer_2: wan.WanTransformer | nnx.State | None = None,
        boundary_ratio: float | None = None,
        expand_timesteps: bool = False,
        offload_idle_expert: bool = False,
        scheduler: unipc.UniPCConfig | None = None,
        encode: Encoder | None = None,
        decode: Decoder | None = None,
        encode_image: ImageEncoder | None = None,
        vae_scale_factor_spatial: int | None = None,
        vae_scale_factor_temporal: int | None = None,
        kernel: dict[str, Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(mesh, encode=encode, decode=decode)
        if (transformer_2 is None) != (boundary_ratio is None):
            raise ValueError(
                "Wan 2.2's two experts need both transformer_2 and boundary_ratio (got "
                f"transformer_2={'set' if transformer_2 is not None else None}, boundary_ratio={boundary_ratio})"
            )
        if offload_idle_expert and transformer_2 is None:
            raise ValueError(
                "offload_idle_expert applies to two-expert pipelines (Wan 2.2 A14B): no transformer_2"
            )
        if expand_timesteps and transformer_2 is not None:
            raise ValueError("expand_timesteps (TI2V) with two experts is no Wan 2.2 release")
        self.model = model  # with offload_idle_expert the parameters' truth is ``forward.state``
        self.config: wan.WanConfig = model.config
        self.dtype = model.dtype
        self.compiler_options = compiler_options
        self.forward = self.plain_forward(wan.sharded, model, kernel)
        self.boundary_ratio = boundary_ratio
        self.expand_timesteps = expand_timesteps
        self.experts = None
        #: The LoRAs fused into the low-noise expert (``load_lora(..., load_into_transformer_2=True)``).
        self.loras_2: FusedLoras | None = None
        if transformer_2 is not None:
            transformer_2 = self._second_expert_state(transformer_2)
            # The plain loop's forward, or under PipeFusion the stage layout: what computes with the expert.
            holder = self.forward if self.forward is not None else model
            self.experts = TwoExperts(holder, transformer_2, offload_idle_expert=offload_idle_expert)
        self.scheduler = scheduler
        self.encode_image = encode_image
        temporal, spatial = self.config.vae_factors  # the VAE the latent width names, unless told
        self.vae_scale_factor_spatial = vae_scale_factor_spatial or spatial
        self.vae_scale_factor_temporal = vae_scale_factor_temporal or temporal
        sampler = UniPCSampler(scheduler or unipc.UniPCConfig())
        # Under PipeFusion ``model`` is the stage layout (PipeFusionWan); the token hooks are the plain loop's.
        self.denoiser = self.denoiser_for(
            model,
            sampler,
            patches=WanPatches,
            kernel=kernel,
            compiler_options=compiler_options,
            token_hooks=token_hooks(self.config),
            dtype=self.dtype,
            experts=None if self.experts is None else self.experts.params,
        )

    def _second_expert_state(self, transformer_2: Any) -> Any:
        """The low-noise expert's parameters in this pipeline's layout: a module's state (under PipeFusion
        a ``PipeFusionWan``'s, or a plain ``WanTransformer`` laid out in stage slots here); an
        ``nnx.State`` as it is (already in the layout: ``TwoExperts`` checks its shapes)."""
        if isinstance(transformer_2, nnx.State):
            return transformer_2
        if transformer_2.config != self.config:
            raise ValueError(config_difference(self.config, transformer_2.config))
        if isinstance(transformer_2, PipeFusionWan):
            return transformer_2.state
        if self.parallel.pipefusion > 1:
            return PipeFusionWan.from_model(transformer_2, self.mesh).state
        return nnx.state(transformer_2)

    # ------------------------------------------------------------------ LoRA, per expert
    def lora_targets(self, expert: int = HIGH_NOISE) -> tuple[Any, Any, Any]:
        """What ``load_lora`` fuses into: with two experts, ``expert``'s parameters, brought onto the mesh
        first when it waits in host memory (``offload_idle_expert``: the other one goes out)."""
        state, config, orders = super().lora_targets()
        return (state if self.experts is None else self.experts.params(expert)), config, orders

    def load_lora(
        self, loras: Any, scale: float = 1.0, *, load_into_transformer_2: bool = False
    ) -> FusedLoras:
        """As :meth:`DiffusionPipeline.load_lora`. Wan 2.2 A14B's LoRAs come per expert, as in diffusers:
        the file goes into ``transformer`` (the high-noise expert) unless ``load_into_transformer_2``, which
        puts it into the low-noise expert instead (``loras_2``); a LoRA meant for both is loaded twice."""
        if not load_into_transformer_2:
            return super().load_lora(loras, scale)
        if self.experts is None:
            raise ValueError(
                "load_into_transformer_2: this pipeline has one transformer; only Wan 2.2 A14B has a "
                "second (low-noise) expert"
            )
        targets = functools.partial(self.lora_targets, LOW_NOISE)
        self.loras_2 = fuse_on_top(targets, self.config, self.loras_2, loras, scale)
        return self.loras_2

    def unload_lora(self) -> None:
        """Take every loaded LoRA out of both experts' weights (each weight back within one rounding)."""
        super().unload_lora()
        if self.loras_2 is not None:
            unfuse_loras(self.lora_targets(LOW_NOISE)[0], self.loras_2)
            self.loras_2 = None

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        parallel: ParallelConfig | Mesh | None = None,
        dtype: Any = None,
        *,
        preset: str | None = None,
        offload_idle_expert: bool = False,
        kernel: dict[str, Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
        attention_backend: str | None = None,
        fp8: str | None = None,
        **options: Any,
    ) -> WanPipeline:
        """Load a Wan checkpoint (diffusers, original or ``jaxdit convert`` folder) onto a mesh; calls take
        prompt embeddings. Wan 2.2 A14B: a folder holding both experts (``high_noise_model/`` +
        ``low_noise_model/``, or a diffusers pipeline's ``transformer/`` + ``transformer_2/``). ``preset``
        (e.g. ``"wan2.1-t2v-14b"``, ``"wan2.2-ti2v-5b"``): the checkpoint must be that architecture,
        checked, like the heads against the mesh, before any weight is read; a Wan 2.2 preset also gives
        the pipeline settings a bare checkpoint does not carry (boundary_ratio, expand_timesteps)."""
        paths, variant = checkpoint_experts(Path(path), preset)
        if fp8 is not None and (len(paths) != 1 or offload_idle_expert):
            raise ValueError(f"FP8 weights load one-expert Wan checkpoints; {path} holds {len(paths)}")
        if len(paths) == 1 and variant == WanVariant() and not offload_idle_expert:
            return super().from_checkpoint(
                path,
                parallel,
                dtype,
                preset=preset,
                kernel=kernel,
                compiler_options=compiler_options,
                attention_backend=attention_backend,
                fp8=fp8,
                **options,
            )
        model, mesh, arguments = checkpoint_arguments(
            path,
            paths,
            variant,
            parallel,
            dtype,
            preset=preset,
            offload_idle_expert=offload_idle_expert,
            kernel=kernel,
            attention_backend=attention_backend,
        )
        return cls(model, mesh, **arguments, compiler_options=compiler_options, **options)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        parallel: ParallelConfig | Mesh | None = None,
        dtype: Any = None,
        *,
        encoder_device: jax.Device | None = None,
        vae_dtype: Any = jnp.float32,
        offload_idle_expert: bool = False,
        kernel: dict[str, Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
        attention_backend: str | None = None,
        fp8: str | None = None,
        offload_encoders: bool = False,
    ) -> WanPipeline:
        """A downloaded Wan folder -- diffusers ``WanPipeline`` / ``WanImageToVideoPipeline`` layout or Wan's
        original release (Wan 2.1 T2V; Wan 2.2 A14B and TI2V-5B) -- with its umT5 text encoder, VAE (and
        CLIP image encoder for Wan 2.1 I2V), and Wan 2.2's second expert and pipeline settings.

        The transformer(s) are sharded over the mesh (``offload_idle_expert``: the idle expert waits in
        host memory); the encoders run on ``encoder_device`` (default: the first local device); the VAE
        decodes (and encodes an I2V first frame) patch-parallel over the mesh, in ``vae_dtype`` (fp32 by
        default, as Wan keeps it). The transformers' heads and key tables are checked before anything is
        read. ``attention_backend``: auto, xla, cudnn, triton or splash (``jaxdit.parallel.kernels``).
        ``fp8``: ``"weight"`` or ``"matmul"``: the transformer blocks' linear layers in FP8
        (``jaxdit.models.fp8``; plain meshes, not PipeFusion; one expert).
        ``offload_encoders``: the text (and image) encoders' weights wait in host memory between prompts (copied to
        ``encoder_device`` for each encode), leaving the device to the transformer.
        """
        model, mesh, arguments = folder_arguments(
            path,
            parallel,
            dtype,
            encoder_device=encoder_device,
            vae_dtype=vae_dtype,
            offload_idle_expert=offload_idle_expert,
            kernel=kernel,
            compiler_options=compiler_options,
            attention_backend=attention_backend,
            fp8=fp8,
            offload_encoders=offload_encoders,
        )
        return cls(model, mesh, **arguments)

    # ------------------------------------------------------------------ call
    def __call__(
        self,
        prompt: str | Sequence[str] | None = None,
        negative_prompt: str | Sequence[str] | None = None,
        *,
        prompt_embeds: np.ndarray | None = None,
        negative_prompt_embeds: np.ndarray | None = None,
        image: np.ndarray | None = None,
        image_embeds: np.ndarray | None = None,
        condition: np.ndarray | None = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        guidance_scale_2: float | None = None,
        flow_shift: float | None = None,
        seed: int = 0,
        latents: np.ndarray | None = None,
        num_videos_per_prompt: int = 1,
        max_sequence_length: int | None = None,
        output_type: str = "np",
        progress: bool = True,
        callback: Callable[[int, int], bool | None] | None = None,
        num_pipeline_patch: int | None = None,
        warmup_steps: int | None = None,
        patch_by: str | None = None,
        cache: Any = None,
    ) -> GenerationOutput:
        """Generate videos; returns latents [B, C, F', H/s, W/s] and, decoded, ``images`` = video frames
        [B, F, H, W, 3] in [-1, 1].

        ``guidance_scale`` > 1 runs classifier-free guidance against the negative conditioning (with a text
        encoder, ``negative_prompt`` defaults to "" as in diffusers); Wan 2.2 A14B: ``guidance_scale`` is
        the high-noise expert's, ``guidance_scale_2`` the low-noise one's (default: ``guidance_scale``).
        ``flow_shift``: UniPC's sigma shift (default: the scheduler's, else 5.0 at 720p / 3.0 at 480p).
        ``latents``: initial noise instead of the seed's. Image-to-video: ``image`` (with an image
        encoder), or ``image_embeds`` (Wan 2.1 only) and ``condition``. ``max_sequence_length``: the text
        encoder's token count (default: the encoder's, 512 for umT5). ``output_type``: np, pil (a list of
        frame lists) or latent. PipeFusion (a mesh with pipefusion > 1): ``num_pipeline_patch``
        (default: the smallest M >= P that splits the latent rows), ``warmup_steps`` (default 1; Wan 2.2
        A14B: at the start of each expert's steps), ``patch_by`` ("rows", default, or "frames"), as
        xDiT's flags.
        ``cache``: a feature cache,
        ``jaxdit.cache.FirstBlockCache(threshold=...)`` or ``TeaCache()`` (the output's ``cache`` reports it).
        """
        kwargs = {k: v for k, v in locals().items() if k not in ("self", "num_videos_per_prompt")}
        return self.generate(GenerationRequest(**kwargs, num_images_per_prompt=num_videos_per_prompt))

    def lower_step(self, **kwargs: Any):
        """The compiled denoising step of a call with these keyword arguments (as ``__call__``'s), lowered
        on its real placed inputs: for reading its collectives (``jaxdit.hlo_stats``) and memory."""
        videos = kwargs.pop("num_videos_per_prompt", 1)
        request = self.with_defaults(GenerationRequest(**kwargs, num_images_per_prompt=videos))
        return self.denoiser.lower(self.prepare(request).inputs)

    # ------------------------------------------------------------------ family hook
    def prepare(self, r: GenerationRequest) -> Prepared:
        """Everything before the loop: conditioning, checks, noise, tokens, each step's expert."""
        num_frames = r.num_frames
        txt = self._embed(r.prompt, r.prompt_embeds, "prompt", r)
        neg = None
        if r.guidance_scale > 1.0:
            negative_prompt = r.negative_prompt
            if negative_prompt is None and r.negative_prompt_embeds is None and self.encode is not None:
                negative_prompt = ""  # diffusers' default negative prompt
            neg = self._embed(negative_prompt, r.negative_prompt_embeds, "negative_prompt", r, len(txt))
        image_embeds, condition = r.image_embeds, r.condition
        if r.image is not None:
            if image_embeds is not None or condition is not None:
                raise ValueError("pass either an image or image_embeds and condition, not both")
            if self.encode_image is None:
                raise ValueError("this pipeline has no image encoder: pass image_embeds and condition")
            image_embeds, condition = self.encode_image(np.asarray(r.image), num_frames, r.height, r.width)
        # Each prompt's videos share its image (diffusers repeats the image features and condition too).
        image_embeds, condition = (
            self.repeat_per_prompt(image_embeds, r),
            self.repeat_per_prompt(condition, r),
        )
        flow_shift = r.flow_shift
        if flow_shift is None and self.scheduler is not None:
            flow_shift = self.scheduler.flow_shift
        plan = check_inputs(
            self.config,
            dataclasses.replace(self.parallel, pipefusion=1),  # PipeFusion's split: its runner checks it
            height=r.height,
            width=r.width,
            num_frames=num_frames,
            num_inference_steps=r.num_inference_steps,
            guidance_scale=r.guidance_scale,
            prompt_embeds=txt.shape,
            negative_prompt_embeds=None if neg is None else neg.shape,
            image_embeds=None if image_embeds is None else np.shape(image_embeds),
            condition=None if condition is None else np.shape(condition),
            latents=None if r.latents is None else np.shape(r.latents),
            flow_shift=flow_shift,
            vae_scale_factor_spatial=self.vae_scale_factor_spatial,
            vae_scale_factor_temporal=self.vae_scale_factor_temporal,
            expand_timesteps=self.expand_timesteps,
            two_experts=self.experts is not None,
            guidance_scale_2=r.guidance_scale_2,
        )
        mc = self.config
        noise = latent_ops.initial_noise(r.seed, plan.latent_shape) if r.latents is None else r.latents
        grid = wan.latent_grid(plan.latent_shape, mc.patch_size)
        tokens = wan.patchify(np.asarray(noise, np.float32), mc.patch_size)
        if plan.cfg:
            txt = self.branches(neg, txt)
        context = {"positions": wan.token_positions(grid), "encoder_hidden_states": txt}
        extras = {}
        if mc.is_i2v:
            # Both branches see the same image; only the text differs (as in diffusers).
            img = np.asarray(image_embeds, np.float32)
            context["encoder_hidden_states_image"] = self.branches(img, img) if plan.cfg else img
        if mc.condition_channels:
            extras["condition"] = wan.patchify(np.asarray(condition, np.float32), mc.patch_size)
        to_latents = lambda t: self.untokenize(t, grid)
        if plan.first_frame:
            first = np.asarray(condition, np.float32)
            in_first = first_frame_tokens(grid, mc.patch_size[0])
            frames = np.zeros(plan.latent_shape, np.float32)
            frames[:, :, :1] = first
            extras["first_frame"] = wan.patchify(frames, mc.patch_size)
            extras["in_first_frame"] = np.broadcast_to(in_first[None, :, None], (*tokens.shape[:2], 1))
            context["timestep_mask"] = (~in_first).astype(np.float32)  # first-frame tokens see t = 0
            to_latents = lambda t: with_first_frame(self.untokenize(t, grid), first)
        scheduler = dataclasses.replace(self.scheduler or unipc.UniPCConfig(), flow_shift=plan.flow_shift)
        schedule = unipc.set_timesteps(scheduler, r.num_inference_steps)
        experts, scales = (), ()
        if self.experts is not None:
            experts = expert_of_steps(schedule.timesteps, self.boundary_ratio, scheduler.num_train_timesteps)
            second = r.guidance_scale if r.guidance_scale_2 is None else r.guidance_scale_2
            scales = guidance_of_steps(experts, r.guidance_scale, second)
        inputs = DenoiseInputs(
            tokens=tokens,
            context=context,
            schedule=schedule,
            steps=r.num_inference_steps,
            cfg=plan.cfg,
            scale=r.guidance_scale,
            extras=extras,
            grid=grid,
            experts=experts,
            scales=scales,
        )
        return Prepared(inputs, to_latents)

    def untokenize(self, tokens: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        """Final tokens (patch embedding's feature order) -> latents [B, C, F', h, w]."""
        mc = self.config
        tokens = swap_features(tokens, mc.out_channels, math.prod(mc.patch_size))
        return np.asarray(wan.unpatchify(tokens, grid, mc.patch_size, mc.out_channels))

    def _embed(
        self, prompt, embeds, name: str, r: GenerationRequest, batch: int | None = None
    ) -> np.ndarray | None:
        if prompt is not None:
            if embeds is not None:
                raise ValueError(f"pass either {name} or {name}_embeds, not both")
            if self.encode is None:
                raise ValueError(f"this pipeline has no text encoder: pass {name}_embeds [B, T, 4096]")
            embeds = self.encode_prompts(prompt, r, batch=batch, what=name)
        else:
            embeds = self.repeat_per_prompt(embeds, r)
        if embeds is None:
            if name == "negative_prompt":
                return None  # check_inputs says what is missing
            raise ValueError(f"pass a {name} or {name}_embeds [B, T, {self.config.text_dim}]")
        return np.asarray(embeds, np.float32)
