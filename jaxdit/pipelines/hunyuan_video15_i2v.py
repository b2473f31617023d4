"""Image-to-video sampling with a HunyuanVideo 1.5 transformer on a mesh (diffusers'
``HunyuanVideo15ImageToVideoPipeline`` call, ``pipelines/hunyuan_video1_5/
pipeline_hunyuan_video1_5_image2video.py``).

The text-to-video pipeline's loop, prompts, guidance and decoding (``pipelines/hunyuan_video15.py``),
with the first frame as conditioning (``pipelines/hunyuan_video15_image.py``): its latents and mask as
the transformer's condition channels beside every noisy token (per-token extras of the loop, so they are
sharded with the tokens), its SigLIP tokens as the image token group (the same for both CFG branches).
The first frame is encoded by the VAE row-parallel over every device of the mesh, as the decode
(``vae/hunyuan_video15_vae_mesh.py``); SigLIP runs on the encoders' device. A MeanFlow transformer
(``use_meanflow``) gets the next step's timestep as ``timestep_r`` (0 at the last step), as diffusers'
image-to-video pipeline passes it (its text-to-video pipeline passes none).
As diffusers, the video's size is the picture's size bucket, not a call argument: a call that gives
another height or width is refused. Without the encoders (a bare pipeline, ``jaxdit plan --verify``'s
abstract step) a call gives the conditioning itself, as Wan's: ``image_embeds`` [B, I, C3] and
``condition`` [B, 33, F', H', W'] (the scaled first-frame latent in the first latent frame, then the mask),
with the height and width they were made for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdit.loading.hunyuan_video15 import load_hunyuan_video15_image_encoder
from jaxdit.models import hunyuan_video15 as hv
from jaxdit.pipelines.base import GenerationOutput, Prepared
from jaxdit.pipelines.denoiser import TokenHooks
from jaxdit.pipelines.hunyuan_video15 import HunyuanVideo15Pipeline, default_size
from jaxdit.pipelines.hunyuan_video15_image import FirstFrame, SiglipProcessor, rgb_pictures
from jaxdit.pipelines.model_folder import FolderClass
from jaxdit.pipelines.request import GenerationRequest

__all__ = ["FOLDER_CLASSES", "HunyuanVideo15ImageToVideoPipeline", "picture_size"]

FOLDER_CLASSES = {
    "HunyuanVideo15ImageToVideoPipeline": FolderClass(
        "hunyuan-video15-i2v",
        "hunyuan-video15-i2v",
        ("transformer", "vae", "scheduler", "guider", "image_encoder", "feature_extractor"),
        optional=("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
        takes_image=True,
        classes={
            "transformer": ("HunyuanVideo15Transformer3DModel",),
            "vae": ("AutoencoderKLHunyuanVideo15",),
            "image_encoder": ("SiglipVisionModel",),
        },
    )
}


def picture_size(picture_hw: tuple[int, int], target_size: int, spatial: int = 16) -> tuple[int, int]:
    """(height, width) diffusers draws a picture of (height, width) ``picture_hw`` at: its size bucket."""
    h, w = picture_hw
    return default_size(target_size, spatial, aspect=(w, h))


class HunyuanVideo15ImageToVideoPipeline(HunyuanVideo15Pipeline):
    """:class:`HunyuanVideo15Pipeline` with a first frame.

    Args (beyond the text-to-video pipeline's):
      first_frame: ``(pictures, num_frames, height, width) -> (image_embeds, condition)``
        (:class:`~jaxdit.pipelines.hunyuan_video15_image.FirstFrame`).
    """

    folder_classes = FOLDER_CLASSES

    def __init__(self, model: Any, mesh: Any, *, first_frame: Any = None, **options: Any) -> None:
        super().__init__(model, mesh, **options)
        self.first_frame = first_frame
        self.default_size = None  # the picture's size bucket, per call

    def token_hooks(self, extra: int) -> TokenHooks:
        """The first frame's latents and mask (the per-token extras ``condition``) beside each token; a
        MeanFlow model also gets ``timestep_r``, the next step's timestep (0 at the last step), as
        diffusers' image-to-video pipeline passes it."""
        step_inputs = {"timestep_r": self.sampler.next_time} if self.config.use_meanflow else {}
        return TokenHooks(
            model_input=lambda x, extras: jnp.concatenate([x, extras["condition"].astype(x.dtype)], -1),
            extra_features=extra,
            step_inputs=step_inputs,
        )

    @classmethod
    def folder_extras(
        cls, folder: Any, vae: Any, device: Any, dtype: Any, on_mesh: Any = None, mesh: Any = None
    ) -> dict[str, Any]:
        """The VAE's encoder for the first frame, row-parallel over every device of ``mesh`` as the
        decode (``on_mesh``: ``HunyuanVideo15MeshVAE``; without it, one device), and the SigLIP encoder
        with its processor settings on the encoders' device."""
        vae_dtype = jax.tree.leaves(nnx.state(vae))[0].dtype
        if on_mesh is not None:
            # Pixel rows in bands of a multiple of 16 (the encoder's compression) per device; a height the
            # devices do not divide is padded at the end, as the decode pads its latent rows (a device may
            # hold padding only: 48 pixel rows on 4 devices are bands of 16, the last all padding).
            def encode_pixels(px: np.ndarray) -> np.ndarray:
                return np.asarray(on_mesh.encode(jnp.asarray(px, vae_dtype), mesh), np.float32)
        else:
            graphdef, state = nnx.split(vae)
            encode_fn = jax.jit(lambda s, x: nnx.merge(graphdef, s).encode(x))

            def encode_pixels(px: np.ndarray) -> np.ndarray:
                return np.asarray(encode_fn(state, jnp.asarray(px, vae_dtype)), np.float32)

        siglip = load_hunyuan_video15_image_encoder(folder["image_encoder"], device=device, dtype=dtype)
        sg, ss = nnx.split(siglip)
        siglip_fn = jax.jit(lambda s, px: nnx.merge(sg, s)(px))
        (where,) = {d for leaf in jax.tree.leaves(ss) for d in leaf.devices()}
        first_frame = FirstFrame(
            encode_pixels=encode_pixels,
            image_encoder=lambda px: np.asarray(siglip_fn(ss, jax.device_put(px, where)), np.float32),
            processor=SiglipProcessor.from_folder(Path(folder["feature_extractor"])),
            scaling_factor=vae.config.scaling_factor,
            temporal=vae.config.temporal_compression_ratio,
        )
        return {"first_frame": first_frame}

    # ------------------------------------------------------------------ call
    def __call__(
        self,
        image: Any = None,
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
        image_embeds: np.ndarray | None = None,
        condition: np.ndarray | None = None,
    ) -> GenerationOutput:
        """As :meth:`HunyuanVideo15Pipeline.__call__` with the first frame ``image`` (a PIL image or an RGB
        array [H, W, 3], uint8 or floats in [0, 1]; one for every video, or one per video). The size is
        the picture's bucket (diffusers' call takes none): ``height`` / ``width``, if given, must be it.
        Instead of ``image``: ``image_embeds`` (the SigLIP tokens) and ``condition`` (first-frame latent and
        mask channels, [B, C + 1, F', H', W']) with ``height`` and ``width``."""
        return self.generate(GenerationRequest.of(**{k: v for k, v in locals().items() if k != "self"}))

    def with_defaults(self, request: GenerationRequest) -> GenerationRequest:
        """The picture's size bucket as the height and width (a call giving others is refused)."""
        if request.image is None:
            if request.image_embeds is None and request.condition is None:
                raise ValueError("HunyuanVideo 1.5 image-to-video needs the first frame: pass image=")
            if request.height is None or request.width is None:
                raise ValueError("image_embeds and condition without image need the height and width")
            return super().with_defaults(request)
        pictures = rgb_pictures(request.image)
        size = picture_size(pictures.shape[1:3], self.config.target_size, self.spatial_factor)
        given = (request.height, request.width)
        if given != (None, None) and given != size:
            raise ValueError(
                f"HunyuanVideo 1.5 image-to-video draws at the picture's size bucket {size[0]}x{size[1]} "
                f"(a {pictures.shape[1]}x{pictures.shape[2]} picture, target size {self.config.target_size}); "
                f"height x width {given[0]}x{given[1]} cannot be asked for"
            )
        return super().with_defaults(request.replace(height=size[0], width=size[1]))

    def prepare(self, r: GenerationRequest) -> Prepared:
        given = r.image_embeds is not None or r.condition is not None
        if r.image is not None and given:
            raise ValueError("pass either image or image_embeds and condition, not both")
        if r.image is None and (r.image_embeds is None or r.condition is None):
            raise ValueError("HunyuanVideo 1.5 image-to-video needs image, or image_embeds and condition")
        if r.image is not None and self.first_frame is None:
            raise ValueError(
                "this pipeline has no VAE encoder and image encoder (from_pretrained builds them): "
                "pass image_embeds and condition instead of image"
            )
        c = self.config
        if given:  # checked before the prompt's conditioning: a wrong shape says so at once
            frames, h, w = self.latent_shape(r.height, r.width, r.num_frames)
            want = (c.in_channels - c.out_channels, frames, h, w)
            if np.ndim(r.condition) != 5 or tuple(np.shape(r.condition)[1:]) != want:
                raise ValueError(
                    f"condition has shape {np.shape(r.condition)}; this request needs [B, *{want}]"
                )
            if np.ndim(r.image_embeds) != 3 or len(r.image_embeds) != len(r.condition):
                raise ValueError(
                    f"image_embeds has shape {np.shape(r.image_embeds)}: [B, tokens, {c.image_embed_dim}], "
                    f"one per condition ({len(r.condition)})"
                )
        prepared = super().prepare(r)
        inputs = prepared.inputs
        batch = inputs.tokens.shape[0]
        if given:
            embeds, condition = np.asarray(r.image_embeds, np.float32), np.asarray(r.condition, np.float32)
            count = len(condition)
        else:
            pictures = rgb_pictures(r.image)
            count = len(pictures)
            if count in (1, batch):
                embeds, condition = self.first_frame(pictures, r.num_frames, r.height, r.width)
        if count not in (1, batch):
            raise ValueError(f"{count} first frames for {batch} videos: give one, or one per video")
        if count == 1 and batch > 1:
            embeds, condition = np.repeat(embeds, batch, 0), np.repeat(condition, batch, 0)
        if embeds.shape[-1] != c.image_embed_dim:
            raise ValueError(
                f"the image encoder gives {embeds.shape[-1]}-wide tokens; the transformer takes {c.image_embed_dim}"
            )
        mask = np.ones(embeds.shape[:2], bool)
        context = dict(inputs.context)
        context["image_embeds"] = self.branches(embeds, embeds) if inputs.cfg else embeds
        context["image_embeds_mask"] = self.branches(mask, mask) if inputs.cfg else mask
        tokens = np.asarray(hv.patchify(condition, c, c.in_channels - c.out_channels), np.float32)
        inputs = dataclasses.replace(inputs, context=context, extras={"condition": tokens})
        return Prepared(inputs, prepared.to_latents)
