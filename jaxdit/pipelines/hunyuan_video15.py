"""Text-to-video sampling with a HunyuanVideo 1.5 transformer on a mesh (diffusers' ``HunyuanVideo15Pipeline``
call, ``pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py``).

What is HunyuanVideo 1.5's own (the loop, decoding and output types are
:class:`~jaxdit.pipelines.base.DiffusionPipeline`'s):

- conditioning: the Qwen2.5-VL prompt features with their mask (``prompt_embeds`` / ``prompt_embeds_mask``)
  and the ByT5 glyph features with theirs (``prompt_embeds_2`` / ``prompt_embeds_mask_2``; zero features
  under a zero mask for a prompt without quoted text); text-to-video gives diffusers' transformer the
  image encoder's tokens as zeros, which it masks: here they are left out
  (``models/hunyuan_video15.condition_inputs``);
- classifier-free guidance ``uncond + g (cond - uncond)`` whose scale lives in the folder's
  ``guider/guider_config.json`` (diffusers' ``ClassifierFreeGuidance``), not in the call;
- the transformer's input per latent voxel: the noisy latents, then zero condition latents and a zero mask
  (33 channels) for text-to-video;
- flow-matching Euler over ``linspace(1, 0, N + 1)[:-1]`` with the folder scheduler's shift; the model is
  called with the timestep (sigma x 1000), unscaled inside;
- decoding: the latents divided by the VAE's ``scaling_factor``, then the causal VAE patch-parallel over every device of the mesh (``vae/hunyuan_video15_vae_mesh.py``).

The initial noise comes from the seed alone (host, fp32 ``default_rng(seed).standard_normal`` of
[B, 32, (F - 1) / 4 + 1, H / 16, W / 16]), so the same seed gives the same video on every mesh.

The text encoders (``text_encoders/hunyuan_video15_prompt``) run when the folder has them; otherwise
calls take embeddings. Image to video: ``pipelines/hunyuan_video15_i2v.py``. On a mesh with
``pipefusion > 1`` the denoiser is PipeFusion's runner (``pipelines/pipefusion/hunyuan_video15.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from converters.hunyuan_video15 import CHECKPOINTS
from converters.lora import hunyuan_video15 as _lora_layouts  # noqa: F401  registers them: pipe.load_lora reads
from jaxdit.loading.hunyuan_video15 import load_hunyuan_video15_prompt_encoder, load_hunyuan_video15_vae
from jaxdit.mesh import DeviceMesh, ParallelConfig
from jaxdit.models import hunyuan_video15 as hv
from jaxdit.models.hunyuan_video15_config import HunyuanVideo15Config
from jaxdit.parallel.kernels import check_kernel_options, with_backend
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.assemble import as_dtype, check_transformer, load_model
from jaxdit.pipelines.base import DiffusionPipeline, GenerationOutput, Prepared
from jaxdit.pipelines.denoiser import DenoiseInputs, TokenHooks
from jaxdit.pipelines.model_folder import FolderClass, is_listed, open_diffusers_folder
from jaxdit.pipelines.pipefusion.hunyuan_video15 import HunyuanVideo15Patches, PipeFusionHunyuanVideo15
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.samplers import flow_match_euler as euler
from jaxdit.samplers.sampler import EulerSampler
from jaxdit.vae.hunyuan_video15_vae_mesh import HunyuanVideo15MeshVAE

__all__ = ["FOLDER_CLASSES", "HunyuanVideo15Pipeline", "default_size", "read_guider"]

FOLDER_CLASSES = {
    "HunyuanVideo15Pipeline": FolderClass(
        "hunyuan-video15",
        "hunyuan-video15-t2v",
        ("transformer", "vae", "scheduler", "guider"),
        optional=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
        classes={
            "transformer": ("HunyuanVideo15Transformer3DModel",),
            "vae": ("AutoencoderKLHunyuanVideo15",),
        },
    )
}
#: The aspect ratio diffusers draws at when a call gives no size (width : height).
DEFAULT_ASPECT = (16, 9)


@dataclasses.dataclass(frozen=True)
class TimestepEuler(EulerSampler):
    """Flow-matching Euler whose model is called with the timestep (sigma x 1000), as diffusers'
    HunyuanVideo 1.5 pipeline calls it."""

    def model_time(self, schedule: euler.FlowMatchEulerSchedule, i: jax.Array) -> jax.Array:
        return jnp.asarray(schedule.timesteps)[i]

    def next_time(self, schedule: euler.FlowMatchEulerSchedule, i: jax.Array) -> jax.Array:
        """The timestep of step ``i + 1``, 0 after the last step (the terminal sigma): MeanFlow's second
        timestep as diffusers' image-to-video pipeline passes it. ``timesteps`` is ``sigmas[:-1]`` times
        the train steps in fp32, so this is the same number."""
        sigmas = jnp.asarray(schedule.sigmas)
        return sigmas[i + 1] * jnp.float32(self.config.num_train_timesteps)


def default_size(
    target_size: int, spatial: int = 16, aspect: tuple[int, int] = DEFAULT_ASPECT
) -> tuple[int, int]:
    """(height, width) diffusers draws at without a size: among the sizes of about ``target_size``**2
    pixels in ``spatial``-pixel steps (width:height from 1:4 to 4:1), the one whose height/width ratio is
    closest to the aspect's from the wide side, as ``HunyuanVideo15ImageProcessor`` picks it."""
    budget = round((target_size / spatial) ** 2)
    sizes, a, b = [], budget, 1  # (a, b) patches: a shrinks as b grows, a * b <= budget
    while a > 0:
        if max(a, b) / min(a, b) <= 4.0:
            sizes.append((a * spatial, b * spatial))
        if (b + 1) * a <= budget:
            b += 1
        else:
            a -= 1
    want = aspect[1] / aspect[0]  # height / width
    ratios = [round(x / y, 5) for x, y in sizes]  # diffusers reads each pair as (height, width)
    fits = [(abs(r - want), i) for i, r in enumerate(ratios) if (r <= want if want >= 1 else r >= want)]
    return sizes[min(fits)[1]]


def read_guider(folder: Path) -> float:
    """The CFG scale of a folder's ``guider/guider_config.json`` (diffusers' ``ClassifierFreeGuidance``);
    settings this pipeline does not run are refused."""
    path = folder / "guider" / "guider_config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no guider/guider_config.json (the pipeline's CFG scale lives there)")
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("_class_name", "ClassifierFreeGuidance") != "ClassifierFreeGuidance":
        raise ValueError(f"{path}: guider {data['_class_name']!r} is not supported (ClassifierFreeGuidance)")
    unsupported = {
        "guidance_rescale": 0.0,
        "use_original_formulation": False,
        "start": 0.0,
        "stop": 1.0,
    }
    for key, plain in unsupported.items():
        if data.get(key, plain) != plain:
            raise ValueError(f"{path}: {key}={data[key]!r} is not supported (only {plain!r})")
    return float(data.get("guidance_scale", 7.5)) if data.get("enabled", True) else 1.0


class HunyuanVideo15Pipeline(DiffusionPipeline):
    """A HunyuanVideo 1.5 transformer on a mesh plus a sampler and optional decoder.

    Args:
      model: a ``HunyuanVideo15Transformer`` placed for ``mesh`` (``jaxdit.loading.load_params``); on a
        mesh with ``pipefusion > 1``, its stage layout (``PipeFusionHunyuanVideo15``).
      mesh: from ``ParallelConfig.make_mesh``.
      scheduler: flow-matching Euler settings (the folder's ``scheduler_config.json``).
      guidance_scale: the folder guider's CFG scale (a call may override it).
      encode: prompts -> (prompt embeds [B, T, C], mask [B, T], glyph embeds [B, G, C2], glyph mask [B, G])
        (``text_encoders/hunyuan_video15_prompt``).
      decode: latents [B, 32, F', h, w] (already divided by the VAE's scaling factor) -> frames
        [B, F, H, W, 3] in [-1, 1].
      kernel: attention kernel options; compiler_options: XLA options for the compiled step.
    """

    cfg_hint = "pass negative prompt embeddings with a guider scale > 1"
    checkpoints = CHECKPOINTS
    staged_model = PipeFusionHunyuanVideo15
    pipefusion_caches = frozenset({"magcache", "taylorseer"})  # host-planned: pipelines/pipefusion/cache.py

    def __init__(
        self,
        model: Any,
        mesh: Mesh,
        *,
        scheduler: euler.FlowMatchEulerConfig | None = None,
        guidance_scale: float = 6.0,
        encode: Callable[..., tuple[np.ndarray, ...]] | None = None,
        decode: Callable[[np.ndarray], np.ndarray] | None = None,
        scaling_factor: float = 1.03682,
        spatial_factor: int = 16,
        temporal_factor: int = 4,
        kernel: dict[str, Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(mesh, encode=encode, decode=decode)
        self.model = model
        self.config: HunyuanVideo15Config = model.config
        c = self.config
        self.scheduler = scheduler or euler.FlowMatchEulerConfig(shift=7.0)
        self.sampler = TimestepEuler(self.scheduler)
        self.guidance_scale = guidance_scale
        self.scaling_factor = scaling_factor
        self.spatial_factor, self.temporal_factor = spatial_factor, temporal_factor
        self.default_size = default_size(c.target_size, spatial_factor)
        per_token = math.prod(c.patch)
        extra = (c.in_channels - c.out_channels) * per_token  # zero condition latents and mask (T2V)
        if extra < 0:
            raise ValueError(
                f"in_channels {c.in_channels} < out_channels {c.out_channels}: not a T2V/I2V model"
            )
        self.hooks = self.token_hooks(extra)
        self.forward = self.plain_forward(hv.sharded, model, kernel)
        self.denoiser = self.denoiser_for(
            model,
            self.sampler,
            patches=HunyuanVideo15Patches,
            kernel=kernel,
            compiler_options=compiler_options,
            token_hooks=self.hooks,
        )

    def token_hooks(self, extra: int) -> TokenHooks:
        """Text-to-video: zero condition latents and a zero mask (``extra`` features) beside each token.
        No second timestep for a MeanFlow model: diffusers' text-to-video pipeline passes none, so its
        transformer leaves the term out (the image-to-video pipeline passes one)."""
        return TokenHooks(
            model_input=lambda x, extras: jnp.concatenate(
                [x, jnp.zeros((*x.shape[:-1], extra), x.dtype)], -1
            ),
            extra_features=extra,
        )

    # ------------------------------------------------------------------ builders
    #: The diffusers pipeline classes ``from_pretrained`` reads.
    folder_classes: Mapping[str, FolderClass] = FOLDER_CLASSES

    @classmethod
    def folder_extras(
        cls, folder: Any, vae: Any, device: Any, dtype: Any, on_mesh: Any = None, mesh: Mesh | None = None
    ) -> dict[str, Any]:
        """Builder arguments a subclass reads from the folder beside the shared ones (none here);
        ``on_mesh``: the VAE row-parallel over the devices of ``mesh``."""
        return {}

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
        encoder_device: jax.Device | None = None,
    ) -> HunyuanVideo15Pipeline:
        """A diffusers ``HunyuanVideo15Pipeline`` folder (``transformer/``, ``vae/``, ``scheduler/``,
        ``guider/``, and the text encoders where the folder has them) on the mesh of ``parallel``: the
        transformer sharded over the mesh, the VAE decoding (and an image-to-video folder's first frame
        encoding) patch-parallel over all its devices, the text encoders (and the image encoder) on one
        device (``encoder_device``, default the first). Its heads, key table and guider are checked before any weight is read."""
        kernel = with_backend(kernel, attention_backend)
        check_kernel_options(kernel)
        folder = open_diffusers_folder(Path(path), cls.folder_classes)
        where = DeviceMesh.of(parallel)
        check_transformer(folder["transformer"], where, CHECKPOINTS)
        scale = read_guider(folder.root)
        dtype = as_dtype(dtype)
        vae_dtype = jnp.dtype(dtype or jnp.float32)
        vae = load_hunyuan_video15_vae(folder["vae"], vae_dtype)
        # The decode runs patch-parallel over every device of the mesh (rows split, halo rows exchanged).
        on_mesh = HunyuanVideo15MeshVAE(vae, compiler_options=compiler_options)

        def decode(z: np.ndarray) -> np.ndarray:
            video = np.asarray(on_mesh.decode(jnp.asarray(z, vae_dtype), where.mesh), np.float32)
            return video.transpose(0, 2, 3, 4, 1)  # [B, F, H, W, 3]

        model = load_model(folder["transformer"], where, dtype, CHECKPOINTS, staged=PipeFusionHunyuanVideo15)
        encode = None
        if all(
            is_listed(folder.index, c) for c in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
        ):
            encode = load_hunyuan_video15_prompt_encoder(folder.root, device=encoder_device, dtype=dtype)
        return cls(
            model,
            where,
            scheduler=euler.FlowMatchEulerConfig.from_diffusers(folder.scheduler_config),
            guidance_scale=scale,
            encode=encode,
            decode=decode,
            scaling_factor=vae.config.scaling_factor,
            spatial_factor=vae.config.spatial_compression_ratio,
            temporal_factor=vae.config.temporal_compression_ratio,
            kernel=kernel,
            compiler_options=compiler_options,
            **cls.folder_extras(folder, vae, encoder_device, dtype, on_mesh, where.mesh),
        )

    # ------------------------------------------------------------------ call
    def __call__(
        self,
        prompt: str | Sequence[str] | None = None,
        *,
        negative_prompt: str | Sequence[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_frames: int = 121,
        num_inference_steps: int = 50,
        sigmas: Sequence[float] | None = None,
        guidance_scale: float | None = None,
        num_images_per_prompt: int = 1,
        seed: int = 0,
        latents: np.ndarray | None = None,
        prompt_embeds: np.ndarray | None = None,
        prompt_embeds_mask: np.ndarray | None = None,
        prompt_embeds_2: np.ndarray | None = None,
        prompt_embeds_mask_2: np.ndarray | None = None,
        negative_prompt_embeds: np.ndarray | None = None,
        negative_prompt_embeds_mask: np.ndarray | None = None,
        negative_prompt_embeds_2: np.ndarray | None = None,
        negative_prompt_embeds_mask_2: np.ndarray | None = None,
        output_type: str = "np",
        progress: bool = True,
        callback: Callable[[int, int], bool | None] | None = None,
        cache: Any = None,
        num_pipeline_patch: int | None = None,
        warmup_steps: int | None = None,
    ) -> GenerationOutput:
        """Generate videos, as diffusers' ``HunyuanVideo15Pipeline``: from prompts (the empty one as the
        negative by default) or embeddings; CFG runs when the scale (the folder guider's unless
        ``guidance_scale``) is not 1;
        ``sigmas``: the unshifted schedule (default ``linspace(1, 0, N + 1)[:-1]``); ``latents``: initial
        noise [B, 32, F', H/16, W/16] instead of the seed's. ``output_type``: np (frames [B, F, H, W, 3] in
        [-1, 1]) or latent. ``cache``: a feature cache (``jaxdit.cache.FirstBlockCache``). PipeFusion (a mesh with pipefusion >
        1): ``num_pipeline_patch``, ``warmup_steps``. The masks, glyph embeddings and ``sigmas`` are this family's own arguments."""
        return self.generate(GenerationRequest.of(**{k: v for k, v in locals().items() if k != "self"}))

    # ------------------------------------------------------------------ family hook
    def latent_shape(self, height: int, width: int, frames: int) -> tuple[int, int, int]:
        s, t = self.spatial_factor, self.temporal_factor
        p = self.config.patch_size * s
        if height % p or width % p:
            raise ValueError(f"height and width must be multiples of {p}; got {height}x{width}")
        if frames < 1 or (frames - 1) % (t * self.config.patch_size_t):
            raise ValueError(f"num_frames {frames}: HunyuanVideo 1.5 takes 1 + k * {t} frames")
        return (frames - 1) // t + 1, height // s, width // s

    def prepare(self, r: GenerationRequest) -> Prepared:
        c, own = self.config, r.family_arguments
        scale = self.guidance_scale if r.guidance_scale is None else r.guidance_scale
        cfg = not math.isclose(scale, 1.0)
        self.check_cfg(cfg)
        pos = self._conditioning(r, r.prompt, "")
        batch = len(pos["encoder_hidden_states"])
        if cfg:
            negative = r.negative_prompt
            if negative is None and r.negative_prompt_embeds is None and r.prompt is not None:
                negative = ""  # diffusers encodes the empty prompt
            neg = self._conditioning(r, negative, "negative_", batch)
            if len(neg["encoder_hidden_states"]) != batch:
                raise ValueError(f"{len(neg['encoder_hidden_states'])} negative prompts for {batch} prompts")
            for name in ("encoder_hidden_states", "encoder_hidden_states_2"):
                length = max(pos[name].shape[1], neg[name].shape[1])  # masked padding: exact
                pos, neg = _pad(pos, name, length), _pad(neg, name, length)
            context = {k: self.branches(neg[k], pos[k]) for k in pos}
        else:
            context = pos
        self.check_batch(batch, "videos")
        frames, h, w = self.latent_shape(r.height, r.width, r.num_frames)
        shape = (batch, c.out_channels, frames, h, w)
        if r.latents is not None and np.shape(r.latents) != shape:
            raise ValueError(f"latents have shape {np.shape(r.latents)}; this request needs {shape}")
        noise = (
            latent_ops.initial_noise(r.seed, shape)
            if r.latents is None
            else np.asarray(r.latents, np.float32)
        )
        tokens = np.asarray(hv.patchify(noise, c, c.out_channels), np.float32)
        grid = hv.latent_grid(shape, c)
        context = hv.condition_inputs(
            context["encoder_hidden_states"],
            context["encoder_attention_mask"],
            context["encoder_hidden_states_2"],
            context["encoder_attention_mask_2"],
            None,  # text-to-video: no image tokens
            c,
        )
        context = {k: v for k, v in context.items() if v is not None}  # text-to-video: no image group
        context["video_ids"] = hv.token_positions(grid)
        sigmas = own.get("sigmas")
        if sigmas is not None and len(sigmas) != r.num_inference_steps:
            raise ValueError(f"{len(sigmas)} sigmas for {r.num_inference_steps} steps: give one per step")
        given = (
            np.linspace(1.0, 0.0, r.num_inference_steps + 1)[:-1] if sigmas is None else np.asarray(sigmas)
        )
        inputs = DenoiseInputs(
            tokens=tokens,
            context=context,
            schedule=euler.set_timesteps(self.scheduler, sigmas=given, mu=None),
            steps=r.num_inference_steps,
            cfg=cfg,
            scale=scale,
            grid=grid,
        )
        return Prepared(inputs, lambda t: np.asarray(hv.unpatchify(np.asarray(t, np.float32), grid, c)))

    def generate(self, request: GenerationRequest) -> GenerationOutput:
        """As the base class, with the latents divided by the VAE's scaling factor before decoding (the
        output's ``latents`` are the sampler's, as diffusers' ``output_type="latent"``)."""
        decode = self.decode
        if decode is not None:
            self.decode = lambda z: decode(np.asarray(z, np.float32) / self.scaling_factor)
        try:
            return super().generate(request)
        finally:
            self.decode = decode

    def _conditioning(
        self, r: GenerationRequest, prompt: Any, which: str, batch: int | None = None
    ) -> dict[str, np.ndarray]:
        """One branch's embeddings and masks from its prompt or the request's embeddings (``which``: ""
        or "negative_")."""
        own, c = r.family_arguments, self.config
        embeds = r.prompt_embeds if which == "" else r.negative_prompt_embeds
        if prompt is not None:
            if embeds is not None:
                raise ValueError(f"pass either a {which}prompt or {which}prompt_embeds, not both")
            if self.encode is None:
                raise ValueError(
                    f"this pipeline has no text encoders: pass {which}prompt_embeds / {which}prompt_embeds_mask "
                    f"and {which}prompt_embeds_2 / {which}prompt_embeds_mask_2"
                )
            encoded = self.encode_prompts(prompt, r, batch=batch, what=which + "prompt")
            out = dict(zip(_NAMES, (np.asarray(x) for x in encoded), strict=True))
            for k in ("encoder_attention_mask", "encoder_attention_mask_2"):
                out[k] = out[k].astype(bool)
            return out
        arrays = {
            "encoder_hidden_states": embeds,
            "encoder_attention_mask": own.get(f"{which}prompt_embeds_mask"),
            "encoder_hidden_states_2": own.get(f"{which}prompt_embeds_2"),
            "encoder_attention_mask_2": own.get(f"{which}prompt_embeds_mask_2"),
        }
        missing = [k for k, v in zip(_ARGUMENTS, arrays.values(), strict=True) if v is None]
        if missing:
            raise ValueError(f"pass {', '.join(which + m for m in missing)} (or a {which}prompt)")
        out = {k: self.repeat_per_prompt(np.asarray(v), r) for k, v in arrays.items()}
        out["encoder_hidden_states"] = out["encoder_hidden_states"].astype(np.float32)
        out["encoder_hidden_states_2"] = out["encoder_hidden_states_2"].astype(np.float32)
        for k in ("encoder_attention_mask", "encoder_attention_mask_2"):
            out[k] = out[k].astype(bool)
        hv.condition_inputs(*out.values(), None, c)  # shapes checked here, with the argument names
        return out


_ARGUMENTS = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
_NAMES = (
    "encoder_hidden_states",
    "encoder_attention_mask",
    "encoder_hidden_states_2",
    "encoder_attention_mask_2",
)


def _pad(arrays: Mapping[str, np.ndarray], name: str, length: int) -> dict[str, np.ndarray]:
    """Right-pad one group's features (zeros) and mask (False) to ``length`` tokens."""
    mask_name = name.replace("encoder_hidden_states", "encoder_attention_mask")
    x, m = arrays[name], arrays[mask_name]
    extra = length - x.shape[1]
    return {
        **arrays,
        name: np.pad(x, ((0, 0), (0, extra), (0, 0))),
        mask_name: np.pad(m, ((0, 0), (0, extra))),
    }
