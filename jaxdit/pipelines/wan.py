"""Text-to-video (and image-to-video) sampling with a Wan 2.1 transformer on a mesh.

Mirrors diffusers' ``WanPipeline`` call (pipelines/wan/pipeline_wan.py, diffusers 0.42.1): prompt or prompt
embeddings, a negative prompt for classifier-free guidance ``u + g (c - u)`` (on when ``guidance_scale > 1``),
height, width, num_frames (4n + 1), num_inference_steps, a seed, output_type; the sampler is UniPC on flow
sigmas (:mod:`jaxdit.samplers.unipc`, diffusers' ``UniPCMultistepScheduler(prediction_type="flow_prediction",
use_flow_sigmas=True, flow_shift=...)``), and the devices come from a ``ParallelConfig`` mesh. I2V (as
``WanImageToVideoPipeline``) adds the CLIP image features and the condition latent (4 mask channels, then the
VAE latent of the first frame) that the transformer reads beside the noise.

Data layout. The latent [B, 16, F', H/8, W/8] (F' = (F - 1) / 4 + 1) is patchified into video tokens
[B, N, 64] once, on the host, padded to the mesh's shard-major token layout, and placed with requests over
``data`` and tokens over (``ring``, ``ulysses``) -- logical axes ("request", "seq", None), as FLUX's latents.
The tokens and the UniPC state (three more arrays of the same shape) stay in that layout for the whole
loop: each denoising step is one jitted program (sharded transformer forward, CFG's single exchange of one
prediction, UniPC update) from padded sharded tokens to padded sharded tokens, with no host round trip.
Only after the last step are the tokens gathered, unpadded and unpatchified.

Token features: Wan's patch embedding reads a token's features in (c, t, h, w) order, its head writes them in
(t, h, w, c) order. The tokens keep the input order and the step reorders each token's 64 predicted features
to match (a transpose inside each token's feature vector: no token moves, no device talks to another).

Padding: the padded tokens are zero patches at position (0, 0, 0); attention masks them as keys, so they
never touch a real token, and they are dropped at the end.

The initial noise comes from the seed alone (host, fp32): the same seed gives the same video on every mesh.

Encoders and the VAE plug in as callables, as in ``FluxPipeline``: ``encode(prompts) -> [B, T, 4096]`` (umT5,
zero-padded to 512 tokens as Wan does), ``decode(latents [B, 16, F', h, w]) -> video [B, F, H, W, 3]`` in
[-1, 1], and for I2V ``encode_image(images [B, H, W, 3], num_frames, height, width) -> (image_embeds
[B, 257, 1280], condition [B, 20, F', h, w])``. Without them, calls take ``prompt_embeds`` /
``negative_prompt_embeds`` (and ``image_embeds`` / ``condition``) and ``output_type="latent"``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from converters.wan import CHECKPOINTS
from jaxdit.loading.encoders import load_wan_image_encoder, load_wan_text_encoder
from jaxdit.loading.vae import load_wan_vae
from jaxdit.mesh import ParallelConfig, mesh_for
from jaxdit.models import wan
from jaxdit.models.sharded_forward import validate_forward
from jaxdit.models.wan import swap_features
from jaxdit.parallel.kernels import check_kernel_options, with_backend
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.assemble import as_dtype, check_transformer, load_model
from jaxdit.pipelines.base import DiffusionPipeline, GenerationOutput, Prepared
from jaxdit.pipelines.denoiser import DenoiseInputs, Denoiser, TokenHooks
from jaxdit.pipelines.model_folder import (
    FolderClass,
    ModelFolder,
    is_listed,
    open_diffusers_folder,
    read_json,
)
from jaxdit.pipelines.pipefusion.denoiser import PipeFusionDenoiser
from jaxdit.pipelines.pipefusion.runner import PipeFusionRunner
from jaxdit.pipelines.pipefusion.wan import PipeFusionWan, WanPatches
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.pipelines.wan_image import ImageCondition
from jaxdit.samplers import unipc
from jaxdit.samplers.sampler import UniPCSampler

__all__ = [
    "FOLDER_CLASSES",
    "WanInputs",
    "WanPipeline",
    "check_inputs",
    "default_flow_shift",
    "nearest",
    "open_original_folder",
    "swap_features",
    "token_hooks",
]

Encoder = Callable[[Sequence[str]], np.ndarray]
Decoder = Callable[[np.ndarray], np.ndarray]
ImageEncoder = Callable[[np.ndarray, int, int, int], tuple[np.ndarray, np.ndarray]]

Shape = tuple[int, ...]


_T2V_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
_CLASSES = {"transformer": ("WanTransformer3DModel",), "vae": ("AutoencoderKLWan",)}
#: The diffusers pipeline classes this module runs from a downloaded folder.
FOLDER_CLASSES = {
    "WanPipeline": FolderClass("wan", "wan-t2v", _T2V_COMPONENTS, classes=_CLASSES),
    "WanImageToVideoPipeline": FolderClass(
        "wan",
        "wan-i2v",
        (*_T2V_COMPONENTS, "image_encoder", "image_processor"),
        takes_image=True,
        classes=_CLASSES,
    ),
}

#: Wan's original release: what the T2V folder holds besides the transformer.
ORIGINAL_VAE = "Wan2.1_VAE.pth"
ORIGINAL_T5 = "models_t5_umt5-xxl-enc-bf16.pth"
ORIGINAL_TOKENIZER = "google/umt5-xxl"
ORIGINAL_CLIP = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"


def open_original_folder(root: Path) -> ModelFolder | None:
    """Wan's original release folder (``Wan-AI/Wan2.1-T2V-14B`` and the like): the transformer's
    ``config.json`` and safetensors, ``Wan2.1_VAE.pth``, ``models_t5_umt5-xxl-enc-bf16.pth`` and the
    tokenizer in ``google/umt5-xxl/``; None if ``root`` is not one."""
    if not ((root / ORIGINAL_VAE).exists() or (root / ORIGINAL_T5).exists()):
        return None
    components = {
        "transformer": root,
        "vae": root / ORIGINAL_VAE,
        "text_encoder": root / ORIGINAL_T5,
        "tokenizer": root / ORIGINAL_TOKENIZER,
    }
    missing = [
        str(p.relative_to(root)) for name, p in components.items() if name != "transformer" and not p.exists()
    ]
    if missing:
        raise ValueError(
            f"{root} looks like Wan's original release folder but is missing: {', '.join(missing)}"
        )
    config = read_json(root / "config.json")
    if config.get("model_type") == "i2v" or (root / ORIGINAL_CLIP).exists():
        raise ValueError(
            f"{root} is Wan's original image-to-video release; its CLIP image encoder ({ORIGINAL_CLIP}, "
            "open-clip layout) is not supported: use the diffusers folder (Wan-AI/Wan2.1-I2V-14B-*-Diffusers)"
        )
    return ModelFolder(root, "wan", "wan-t2v", "wan-original", components)


def check_folder(folder: ModelFolder) -> None:
    """What the folder recognition cannot see from the class name: a second transformer (Wan 2.2)."""
    if is_listed(folder.index, "transformer_2"):
        raise ValueError(f"{folder.root} is a two-transformer (Wan 2.2) pipeline; jaxdit runs Wan 2.1")


def open_folder(path: str | os.PathLike[str]) -> ModelFolder:
    """A Wan 2.1 folder in the diffusers or the original layout (see :data:`FOLDER_CLASSES`)."""
    root = Path(path)
    folder = open_original_folder(root) if not (root / "model_index.json").is_file() else None
    if folder is None:
        folder = open_diffusers_folder(root, FOLDER_CLASSES)
    check_folder(folder)
    return folder


def default_flow_shift(height: int, width: int) -> float:
    """The flow shift diffusers' Wan 2.1 docs recommend: 5.0 at 720p and above, 3.0 at 480p (and below)."""
    return 5.0 if min(height, width) >= 720 else 3.0


# --------------------------------------------------------------------------------------------------------
# Checks: shapes only, no devices (``jaxdit generate`` runs them before jax starts)
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WanInputs:
    """What a valid request comes to: the latent shape [B, C, F', h, w] and whether CFG runs."""

    latent_shape: Shape
    cfg: bool
    flow_shift: float

    @property
    def batch(self) -> int:
        return self.latent_shape[0]


def nearest(n: int, step: int, offset: int = 0) -> str:
    below = (n - offset) // step * step + offset
    return f"{below} or {below + step}" if below >= max(offset, 1) else f"{below + step}"


def check_inputs(
    config: wan.WanConfig,
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
) -> WanInputs:
    """Raise ``ValueError`` naming the numbers for anything a Wan generation cannot run with.

    Needs only shapes, no devices or weights. diffusers rounds bad sizes and frame counts with a warning;
    here they are errors, so that what runs is what was asked for.
    """
    validate_forward(parallel, config.num_heads)  # heads vs ulysses x tensor, no pipefusion
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    if flow_shift is not None and not flow_shift > 0:
        raise ValueError(f"flow_shift must be > 0, got {flow_shift}")
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
    extra = config.in_channels - config.out_channels
    if config.is_i2v:
        if image_embeds is None or condition is None:
            raise ValueError(
                "an I2V model needs image_embeds (CLIP features [B, 257, 1280]) and condition (mask + VAE "
                f"latent of the first frame, [B, {extra}, F', H/8, W/8])"
            )
        if len(image_embeds) != 3 or image_embeds[0] != batch or image_embeds[2] != config.image_dim:
            raise ValueError(
                f"image_embeds has shape {tuple(image_embeds)}; expected [{batch}, I, {config.image_dim}]"
            )
        want = (batch, extra, *latent[2:])
        if tuple(condition) != want:
            raise ValueError(f"condition has shape {tuple(condition)}; this request needs {want}")
    else:
        if image_embeds is not None or condition is not None:
            raise ValueError("image_embeds / condition are for I2V models; this is a text-to-video model")
        if extra:
            raise ValueError(
                f"in_channels {config.in_channels} != out_channels {config.out_channels} without image input"
            )
    shift = flow_shift if flow_shift is not None else default_flow_shift(height, width)
    return WanInputs(latent_shape=latent, cfg=cfg, flow_shift=shift)


# --------------------------------------------------------------------------------------------------------
# Pipeline
# --------------------------------------------------------------------------------------------------------


def token_hooks(config: wan.WanConfig) -> TokenHooks:
    """Wan's tokens in the shared loop: I2V reads the condition channels beside each noise token, and the
    head's (patch, channel) features become the patch embedding's (channel, patch) order."""
    patch, channels = math.prod(config.patch_size), config.out_channels
    extra = (config.in_channels - config.out_channels) * patch
    if config.is_i2v:
        model_input = lambda x, extras: jnp.concatenate([x, extras["condition"]], axis=-1)
    else:
        model_input = lambda x, extras: x
    return TokenHooks(
        model_input=model_input,
        prediction=lambda v: swap_features(v, patch, channels),
        extra_features=extra,
    )


class WanPipeline(DiffusionPipeline):
    """A Wan 2.1 transformer on a mesh plus UniPC, optional text/image encoders and VAE decoder.

    Args:
      model: a ``WanTransformer`` whose parameters are placed for ``mesh`` (``jaxdit.loading.load_params``).
      mesh: from ``ParallelConfig.make_mesh``.
      scheduler: UniPC settings; its ``flow_shift`` is used when a call gives none (default: by resolution,
        :func:`default_flow_shift`).
      vae_scale_factor_spatial / vae_scale_factor_temporal: Wan's VAE: 8 and 4.
      kernel: attention kernel options; compiler_options: XLA options for the compiled step.
    """

    cfg_hint = "use guidance_scale > 1 with negative conditioning"
    checkpoints = CHECKPOINTS
    staged_model = PipeFusionWan

    def __init__(
        self,
        model: wan.WanTransformer,
        mesh: Mesh,
        *,
        scheduler: unipc.UniPCConfig | None = None,
        encode: Encoder | None = None,
        decode: Decoder | None = None,
        encode_image: ImageEncoder | None = None,
        vae_scale_factor_spatial: int = 8,
        vae_scale_factor_temporal: int = 4,
        kernel: dict[str, int] | None = None,
        compiler_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(mesh, encode=encode, decode=decode)
        self.model = model
        self.config: wan.WanConfig = model.config
        self.compiler_options = compiler_options
        # XLA options belong to the outermost jit (the step below); jax rejects them on a nested one.
        self.forward = wan.sharded(model, mesh, kernel=kernel) if self.parallel.pipefusion == 1 else None
        self.scheduler = scheduler
        self.encode_image = encode_image
        self.vae_scale_factor_spatial = vae_scale_factor_spatial
        self.vae_scale_factor_temporal = vae_scale_factor_temporal
        sampler = UniPCSampler(scheduler or unipc.UniPCConfig())
        if self.parallel.pipefusion > 1:  # ``model`` is the stage layout (PipeFusionWan)
            runner = PipeFusionRunner(
                WanPatches(model.config), model, kernel=kernel, compiler_options=compiler_options
            )
            self.denoiser = PipeFusionDenoiser(runner, sampler)
        else:
            self.denoiser = Denoiser(
                self.forward,
                sampler,
                token_hooks(self.config),
                dtype=model.dtype,
                compiler_options=compiler_options,
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
        vae_dtype: Any = jnp.float32,
        kernel: dict[str, Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
        attention_backend: str | None = None,
    ) -> WanPipeline:
        """A downloaded Wan 2.1 folder -- diffusers ``WanPipeline`` / ``WanImageToVideoPipeline`` layout or
        Wan's original T2V release -- with its umT5 text encoder, VAE (and CLIP image encoder for I2V).

        The transformer is sharded over the mesh; the encoders run on ``encoder_device`` (default: the first
        local device); the VAE decodes patch-parallel over the mesh, in ``vae_dtype`` (fp32 by default, as
        Wan keeps it). The transformer's heads and key table are checked before anything is read.
        ``attention_backend``: auto, xla, cudnn, triton or splash (``jaxdit.parallel.kernels``).
        """
        kernel = with_backend(kernel, attention_backend)
        check_kernel_options(kernel)
        folder = open_folder(path)
        mesh = mesh_for(parallel)
        check_transformer(folder["transformer"], mesh, CHECKPOINTS)
        dtype = as_dtype(dtype)
        text = load_wan_text_encoder(
            folder.root, dtype=dtype, device=encoder_device, compiler_options=compiler_options
        )
        vae = load_wan_vae(folder["vae"], dtype=as_dtype(vae_dtype), compiler_options=compiler_options)
        encode_image = None
        if "image_encoder" in folder:
            image_encoder = load_wan_image_encoder(
                folder.root, dtype=dtype, device=encoder_device, compiler_options=compiler_options
            )
            encode_image = ImageCondition(image_encoder, vae, mesh=mesh)
        model = load_model(folder["transformer"], mesh, dtype, CHECKPOINTS, staged=PipeFusionWan)

        def decode(z: np.ndarray) -> np.ndarray:
            video = np.asarray(vae.decode_latents(z, mesh=mesh))  # [B, 3, F, H, W]
            return video.transpose(0, 2, 3, 4, 1)  # the pipeline's frames [B, F, H, W, 3]

        scheduler = (
            unipc.UniPCConfig.from_diffusers(folder.scheduler_config) if folder.scheduler_config else None
        )
        return cls(
            model,
            mesh,
            scheduler=scheduler,
            encode=text,
            decode=decode,
            encode_image=encode_image,
            kernel=kernel,
            compiler_options=compiler_options,
        )

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
        """Generate videos; returns latents [B, 16, F', H/8, W/8] and, decoded, ``images`` = video frames
        [B, F, H, W, 3] in [-1, 1].

        ``guidance_scale`` > 1 runs classifier-free guidance against the negative conditioning (with a text
        encoder, ``negative_prompt`` defaults to "" as in diffusers). ``flow_shift``: UniPC's sigma shift
        (default: the scheduler's, else 5.0 at 720p / 3.0 at 480p). ``latents``: initial noise instead of
        the seed's. I2V: ``image`` (with an image encoder) or ``image_embeds`` and ``condition``.
        ``max_sequence_length``: the text encoder's token count (default: the encoder's, 512 for umT5).
        ``output_type``: np, pil (a list of frame lists) or latent. PipeFusion (a mesh with pipefusion > 1):
        ``num_pipeline_patch`` (default: the smallest M >= P that splits the latent rows), ``warmup_steps``
        (default 1), ``patch_by`` ("rows", default, or "frames"), as xDiT's flags.
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
        """Everything before the loop: conditioning, checks, noise, tokens."""
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
            extras["condition"] = wan.patchify(np.asarray(condition, np.float32), mc.patch_size)
        scheduler = dataclasses.replace(self.scheduler or unipc.UniPCConfig(), flow_shift=plan.flow_shift)
        inputs = DenoiseInputs(
            tokens=tokens,
            context=context,
            schedule=unipc.set_timesteps(scheduler, r.num_inference_steps),
            steps=r.num_inference_steps,
            cfg=plan.cfg,
            scale=r.guidance_scale,
            extras=extras,
            grid=grid,
        )
        return Prepared(inputs, lambda t: self.untokenize(t, grid))

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
