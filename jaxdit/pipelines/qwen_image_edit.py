"""Qwen-Image-Edit on a mesh: diffusers' ``QwenImageEditPipeline`` (Qwen-Image-Edit: one input picture)
and ``QwenImageEditPlusPipeline`` (Edit-2509: one or more) calls (``pipelines/qwenimage/
pipeline_qwenimage_edit.py`` and ``pipeline_qwenimage_edit_plus.py``).

A :class:`~jaxdit.pipelines.qwen_image.QwenImagePipeline` (its loop, true CFG with the norm-preserving
rescale, schedule and decoding) whose calls read pictures twice:

- as the text encoder's input: each picture resized to the condition size (``CONDITION_AREA`` pixels at
  its aspect ratio for Plus; the VAE size for Qwen-Image-Edit), then Qwen2.5-VL's image processor and
  vision tower (``text_encoders/qwen_image_edit_prompt``);
- as reference latents: each picture resized to ``VAE_AREA`` pixels at its aspect ratio (sides multiples
  of 32, Lanczos), VAE-encoded (the posterior's mode, normalised by the VAE's ``latents_mean`` /
  ``latents_std``), packed into 2x2 tokens and joined to the noise along the sequence as the
  transformer's reference token group (``models.qwen_image`` group ``REFERENCE``): they enter every step
  clean and leave no prediction. Their RoPE frame index is 1, 2, ... after the denoised image's 0, each
  centred on its own grid, and the text starts past the largest half side of all of them
  (``models.qwen_image_config.edit_rope_positions``).

Edit-2511 (a Plus folder whose transformer sets ``zero_cond_t``) runs the same call; its reference
tokens take the image-stream modulation of timestep 0. The output size defaults to ``VAE_AREA`` pixels
at the aspect ratio of the last picture (Plus) or the picture (Qwen-Image-Edit). The text encoder gets
Qwen2.5-VL's 3-axis positions (what the model was trained with; diffusers 0.42 on transformers 5 drops
the processor's ``mm_token_type_ids`` and so falls back to 1-D positions, diffusers issue 14194). Not
supported (refused): several prompts in one call (diffusers' Plus refuses them too), prompt embeddings
instead of prompts. On a PipeFusion mesh the reference tokens are a context token group of every patch
(``pipelines/pipefusion/qwen_image.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from converters.qwen_image import CHECKPOINTS
from jaxdit.loading.wan import load_wan_vae
from jaxdit.mesh import DeviceMesh, ParallelConfig
from jaxdit.models.qwen_image_config import edit_rope_positions
from jaxdit.parallel.kernels import check_kernel_options, with_backend
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.assemble import as_dtype, check_transformer, load_model
from jaxdit.pipelines.base import GenerationOutput, Prepared
from jaxdit.pipelines.model_folder import FolderClass, open_diffusers_folder
from jaxdit.pipelines.pipefusion.qwen_image import PipeFusionQwenImage
from jaxdit.pipelines.qwen_image import QwenImagePipeline
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.samplers import flow_match_euler as euler
from jaxdit.text_encoders.qwen_image_prompt import MAX_PROMPT_TOKENS

__all__ = [
    "CONDITION_AREA",
    "FOLDER_CLASSES",
    "VAE_AREA",
    "QwenImageEditPipeline",
    "area_size",
    "load_edit_prompt_encoder",
    "picture_problem",
]

_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "processor", "scheduler")
_CLASSES = {
    "transformer": ("QwenImageTransformer2DModel",),
    "vae": ("AutoencoderKLQwenImage",),
    "text_encoder": ("Qwen2_5_VLForConditionalGeneration",),
}
#: The diffusers pipeline classes this module runs from a downloaded folder.
FOLDER_CLASSES = {
    "QwenImageEditPipeline": FolderClass(
        "qwen-image-edit", "qwen-image-edit", _COMPONENTS, takes_image=True, classes=_CLASSES
    ),
    "QwenImageEditPlusPipeline": FolderClass(
        "qwen-image-edit", "qwen-image-edit-plus", _COMPONENTS, takes_image=True, classes=_CLASSES
    ),
}

#: Pixels of the pictures the Plus text encoder reads (diffusers' ``CONDITION_IMAGE_SIZE``).
CONDITION_AREA = 384 * 384
#: Pixels of the pictures the VAE encodes, and of the default output (diffusers' ``VAE_IMAGE_SIZE``).
VAE_AREA = 1024 * 1024


def area_size(area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of ``area`` pixels at width / height's aspect ratio, each side rounded to a multiple
    of 32 (diffusers' ``calculate_dimensions``)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return round(w / 32) * 32, round(h / 32) * 32


#: The largest long side / short side Qwen2-VL's image processor takes (its ``smart_resize`` raises above).
PROCESSOR_MAX_RATIO = 200


def picture_problem(width: int, height: int, *, plus: bool) -> str | None:
    """Why a ``width`` x ``height`` input picture cannot be edited, else None: each resized copy (the
    condition size the text encoder reads, the VAE size) needs sides that round to 32 pixels or more, and
    the condition copy an aspect ratio Qwen2-VL's image processor takes. Checked on the resized sizes,
    where the pipeline would fail (a ratio a little over 200 can round back under it)."""
    condition = area_size(CONDITION_AREA if plus else VAE_AREA, width, height)
    for what, (w, h) in (("condition", condition), ("VAE", area_size(VAE_AREA, width, height))):
        if min(w, h) < 32:
            return f"its {what} copy would be {w}x{h} pixels; each side must come out 32 or more"
    ratio = max(condition) / min(condition)
    if ratio > PROCESSOR_MAX_RATIO:
        return (
            f"its {condition[0]}x{condition[1]} condition copy has an aspect ratio of {ratio:.1f}; "
            f"Qwen2-VL's image processor takes at most {PROCESSOR_MAX_RATIO}"
        )
    return None


def _as_pil(image: Any):
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(
            f"an input picture must be a PIL image or an [H, W, 3] array, got shape {array.shape}"
        )
    if array.dtype != np.uint8:  # diffusers' numpy pictures are floats in [0, 1]
        array = np.round(np.clip(array.astype(np.float32), 0, 1) * 255).astype(np.uint8)
    return Image.fromarray(array)


def _resized(picture: Any, size: tuple[int, int]) -> Any:
    from PIL import Image

    if min(size) < 32:
        raise ValueError(
            f"an input picture of {picture.width}x{picture.height} pixels comes out {size[0]}x{size[1]}"
        )
    return picture.resize(size, resample=Image.LANCZOS)


def load_edit_prompt_encoder(folder: str | os.PathLike[str], *, plus: bool) -> Any:
    """``text_encoder/`` (Qwen2.5-VL with its vision tower), the tokenizer and image processor of
    ``processor/`` (the tokenizer of ``tokenizer/`` where ``processor/`` holds none) -> the encoder."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from jaxdit.loading.qwen_vl_encoder import load_qwen_vl_encoder
    from jaxdit.text_encoders.qwen_image_edit_prompt import QwenImageEditPromptEncoder

    root = Path(folder)
    processor = root / "processor"
    if not (processor / "preprocessor_config.json").is_file():
        raise ValueError(f"{root}: no image processor; expected Qwen2-VL's in {processor}")
    tokens = processor if (processor / "tokenizer_config.json").is_file() else root / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(tokens)
    images = AutoImageProcessor.from_pretrained(processor)
    return QwenImageEditPromptEncoder(
        tokenizer, images, load_qwen_vl_encoder(root / "text_encoder"), plus=plus
    )


class QwenImageEditPipeline(QwenImagePipeline):
    """Qwen-Image-Edit (``plus=False``: one picture) or Edit-2509 (``plus=True``: one or more) on a mesh.

    Args (beyond :class:`QwenImagePipeline`'s): ``encode`` takes ``(prompts, images=[PIL pictures at the
    condition size])``; ``encode_image``: pixels [1, 3, H, W] in [-1, 1] -> normalised latents [1, C,
    H/f, W/f].
    """

    def __init__(
        self,
        model: Any,
        mesh: Mesh,
        *,
        plus: bool = True,
        encode_image: Callable | None = None,
        **options: Any,
    ) -> None:
        super().__init__(model, mesh, **options)
        self.plus, self.encode_image = plus, encode_image

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
        fp8: str | None = None,
        **unsupported: Any,
    ) -> QwenImageEditPipeline:
        """A ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` folder (``transformer/``, ``vae/``,
        ``text_encoder/`` with the vision tower, ``tokenizer/``, ``processor/``, ``scheduler/``) on the
        mesh of ``parallel``. The text encoder runs on one device, in fp32."""
        given = sorted(k for k, v in unsupported.items() if v not in (None, False))
        if given:
            raise ValueError(f"Qwen-Image-Edit does not support {', '.join(given)} yet")
        kernel = with_backend(kernel, attention_backend)
        check_kernel_options(kernel)
        folder = open_diffusers_folder(Path(path), FOLDER_CLASSES)
        where = DeviceMesh.of(parallel)
        mesh = where.mesh
        check_transformer(folder["transformer"], where, CHECKPOINTS)
        dtype = as_dtype(dtype)
        plus = folder.kind == "qwen-image-edit-plus"
        encoder = load_edit_prompt_encoder(folder.root, plus=plus)
        vae = load_wan_vae(folder["vae"], dtype=dtype, compiler_options=compiler_options)
        model = load_model(
            folder["transformer"], where, dtype, CHECKPOINTS, staged=PipeFusionQwenImage, fp8=fp8
        )

        def decode(z: np.ndarray) -> np.ndarray:
            frames = vae.decode_latents(np.asarray(z, np.float32)[:, :, None], mesh=mesh)
            return np.asarray(frames[:, :, 0], np.float32).transpose(0, 2, 3, 1)

        def encode_image(pixels: np.ndarray) -> np.ndarray:
            mean, _ = vae.encode(np.asarray(pixels, np.float32)[:, :, None], mesh=mesh)  # the mode
            return np.asarray(vae.normalize_latents(mean), np.float32)[:, :, 0]

        return cls(
            model,
            where,
            plus=plus,
            scheduler=euler.FlowMatchEulerConfig.from_diffusers(folder.scheduler_config),
            encode=encoder,
            decode=decode,
            encode_image=encode_image,
            latent_channels=model.config.in_channels // 4,
            vae_scale_factor=vae.config.spatial_factor,
            kernel=kernel,
            compiler_options=compiler_options,
        )

    def __call__(
        self,
        image: Any = None,
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
        max_sequence_length: int = MAX_PROMPT_TOKENS,
        output_type: str = "np",
        progress: bool = True,
        callback: Callable[[int, int], bool | None] | None = None,
        num_pipeline_patch: int | None = None,
        warmup_steps: int | None = None,
        cache: Any = None,
    ) -> GenerationOutput:
        """Edit ``image`` (a picture, or a list of them for Plus: PIL images or [H, W, 3] arrays) as
        ``prompt`` says, as diffusers' call with the same arguments; ``latents``: the initial noise [B, C,
        H/f, W/f] instead of the seed's. PipeFusion (a mesh with pipefusion > 1): ``num_pipeline_patch``,
        ``warmup_steps``."""
        return self.generate(GenerationRequest.of(**{k: v for k, v in locals().items() if k != "self"}))

    # ------------------------------------------------------------------ pictures
    def pictures(self, image: Any) -> list[Any]:
        """The call's input pictures as RGB PIL images (refused: none; several for Qwen-Image-Edit)."""
        if image is None:
            raise ValueError("Qwen-Image-Edit edits a picture: pass image= (jaxdit generate --image)")
        items = list(image) if isinstance(image, list | tuple) else [image]
        if not items:
            raise ValueError("Qwen-Image-Edit edits a picture: the image list is empty")
        if not self.plus and len(items) != 1:
            raise ValueError(
                f"Qwen-Image-Edit reads one input picture, got {len(items)} (Qwen-Image-Edit-2509, "
                "QwenImageEditPlusPipeline, reads several)"
            )
        pictures = [_as_pil(p) for p in items]
        for k, p in enumerate(pictures):
            problem = picture_problem(p.width, p.height, plus=self.plus)
            if problem:
                raise ValueError(f"input picture {k} ({p.width}x{p.height} pixels): {problem}")
        return pictures

    def condition_pictures(self, pictures: list[Any]) -> list[Any]:
        area = CONDITION_AREA if self.plus else VAE_AREA
        return [_resized(p, area_size(area, p.width, p.height)) for p in pictures]

    def generate(self, request: GenerationRequest) -> GenerationOutput:
        pictures = self.pictures(request.image)
        if request.prompt is not None and not isinstance(request.prompt, str) and len(request.prompt) > 1:
            raise ValueError(
                "Qwen-Image-Edit takes one prompt per call (diffusers' Plus pipeline refuses more)"
            )
        if request.prompt is None:
            raise ValueError("Qwen-Image-Edit needs a prompt (its embeddings depend on the pictures)")
        last = pictures[-1] if self.plus else pictures[0]
        w, h = area_size(VAE_AREA, last.width, last.height)
        multiple = 2 * self.vae_scale_factor
        height = request.height if request.height is not None else h // multiple * multiple
        width = request.width if request.width is not None else w // multiple * multiple
        return super().generate(request.replace(height=height, width=width))

    def encode_prompts(self, prompt, request, *, batch=None, what="prompt"):
        pictures = self.condition_pictures(self.pictures(request.image))
        encode = self.encode
        if encode is None:
            raise ValueError(f"this pipeline has no text encoder: pass {what}_embeds")
        self.encode = lambda prompts, **options: encode(prompts, images=pictures, **options)
        try:
            return super().encode_prompts(prompt, request, batch=batch, what=what)
        finally:
            self.encode = encode

    def prepare(self, r: GenerationRequest) -> Prepared:
        if r.negative_prompt_embeds is not None or r.prompt_embeds is not None:
            raise ValueError(
                "Qwen-Image-Edit encodes its prompts with the pictures: pass prompts, not embeddings"
            )
        if self.encode_image is None:
            raise ValueError("this pipeline has no VAE encoder: it cannot read the input pictures")
        prepared = super().prepare(r)
        references, grids = [], []
        for picture in self.pictures(r.image):
            resized = _resized(picture, area_size(VAE_AREA, picture.width, picture.height))
            pixels = np.asarray(resized, np.float32) / 255.0 * 2.0 - 1.0
            latent = np.asarray(self.encode_image(pixels.transpose(2, 0, 1)[None]), np.float32)
            references.append(latent_ops.pack(latent))
            grids.append((latent.shape[2] // 2, latent.shape[3] // 2))
        inputs = prepared.inputs
        rows = len(inputs.context["encoder_hidden_states"])  # every request and CFG branch: the pictures
        tokens = np.repeat(np.concatenate(references, axis=1), rows, axis=0)
        txt_ids, img_ids, ref_ids = edit_rope_positions(
            inputs.context["encoder_hidden_states"].shape[1], [inputs.grid, *grids]
        )
        context = dict(
            inputs.context,
            txt_ids=txt_ids.astype(np.float32),
            img_ids=img_ids.astype(np.float32),
            reference_hidden_states=tokens,
            reference_ids=ref_ids.astype(np.float32),
        )
        return Prepared(dataclasses.replace(inputs, context=context), prepared.to_latents)
