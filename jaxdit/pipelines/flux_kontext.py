"""FLUX.1 Kontext [dev]: image editing on a mesh, diffusers' ``FluxKontextPipeline`` call.

Kontext is FLUX.1-dev's transformer (same shapes, guidance embedding) that reads a reference picture
beside the noise: the picture is VAE-encoded (the posterior mean, scaled and shifted like any latent),
packed into 2x2 tokens and joined to the image tokens along the sequence with RoPE ids (1, row, col):
index 1 in the first axis sets it apart from the denoised image at (0, row, col). The reference tokens
are never denoised: they are a token group of the forward's input (``reference_hidden_states``, group
``models.flux.REFERENCE``) that enters every step clean and is dropped from the prediction, so the
shard-major layout, padding, Ulysses, Ring, the feature caches and PipeFusion (which carries a chunk of
them with each patch, like the text) see them as one more group.

Sizes follow diffusers: the output size is rescaled to ``max_area`` pixels at its aspect ratio (1024^2
by default) and rounded down to the VAE factor x 2; the reference picture is snapped to the preferred
resolution of nearest aspect ratio (``PREFERRED_RESOLUTIONS``, Black Forest Labs' list) unless
``auto_resize=False``, rounded down the same way, and resized with Lanczos.
"""

from __future__ import annotations

import dataclasses
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
from jaxdit.parallel.kernels import check_kernel_options, with_backend
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.assemble import as_dtype, check_transformer, load_model
from jaxdit.pipelines.base import GenerationOutput, Prepared
from jaxdit.pipelines.call_options import CallOption
from jaxdit.pipelines.flux import FluxPipeline
from jaxdit.pipelines.model_folder import FolderClass, open_diffusers_folder
from jaxdit.pipelines.pipefusion.flux import PipeFusionFlux
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.samplers import flow_match_euler as euler

__all__ = [
    "FOLDER_CLASSES",
    "PREFERRED_RESOLUTIONS",
    "FluxKontextPipeline",
    "output_size",
    "reference_pixels",
    "reference_size",
]

#: (width, height) pairs Kontext was trained on (diffusers' ``PREFERRED_KONTEXT_RESOLUTIONS``).
PREFERRED_RESOLUTIONS = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184),
    (944, 1104), (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752),
    (1456, 720), (1504, 688), (1568, 672),
)  # fmt: skip

#: The diffusers pipeline class this module runs from a downloaded folder.
FOLDER_CLASSES = {
    "FluxKontextPipeline": FolderClass(
        "flux-kontext",
        "flux-kontext",
        ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"),
        classes={"transformer": ("FluxTransformer2DModel",), "vae": ("AutoencoderKL",)},
    )
}

#: Output pixels a call targets by default (diffusers' ``max_area``).
MAX_AREA = 1024**2


def output_size(height: int, width: int, max_area: int, multiple: int) -> tuple[int, int]:
    """The generated picture's (height, width): ``max_area`` pixels at height x width's aspect ratio,
    each side rounded down to ``multiple`` (the VAE factor x 2), as diffusers computes it."""
    aspect = width / height
    w, h = round((max_area * aspect) ** 0.5), round((max_area / aspect) ** 0.5)
    return h // multiple * multiple, w // multiple * multiple


def reference_size(height: int, width: int, vae_factor: int, auto_resize: bool = True) -> tuple[int, int]:
    """The (height, width) a reference picture of height x width is resized to: its sides rounded down to
    the VAE factor, then (``auto_resize``) the preferred resolution of nearest aspect ratio, then rounded
    down to the VAE factor x 2. Raises ValueError when a side comes out empty."""
    h, w = height - height % vae_factor, width - width % vae_factor
    if min(h, w) < 1:
        raise ValueError(f"the reference image is {width}x{height} pixels: smaller than one latent pixel")
    if auto_resize:
        _, w, h = min((abs(w / h - pw / ph), pw, ph) for pw, ph in PREFERRED_RESOLUTIONS)
    multiple = 2 * vae_factor
    h, w = h // multiple * multiple, w // multiple * multiple
    if min(h, w) < multiple:
        raise ValueError(
            f"the reference image is {width}x{height} pixels; each side needs at least {multiple} "
            f"(the VAE factor {vae_factor} x 2x2 patches)"
        )
    return h, w


def _as_pil(image: Any):
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = np.asarray(image)
    if array.ndim == 4 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"image must be a PIL image or an [H, W, 3] array, got shape {array.shape}")
    if array.dtype != np.uint8:  # diffusers' numpy pictures are floats in [0, 1]
        array = np.round(np.clip(array.astype(np.float32), 0, 1) * 255).astype(np.uint8)
    return Image.fromarray(array)


def reference_pixels(image: Any, vae_factor: int, auto_resize: bool = True) -> np.ndarray:
    """A picture (PIL, or [H, W, 3] uint8 / [0, 1] floats) -> [1, 3, H', W'] fp32 in [-1, 1] at
    :func:`reference_size`, resized with Lanczos as diffusers' image processor does."""
    from PIL import Image

    picture = _as_pil(image)
    h, w = reference_size(picture.height, picture.width, vae_factor, auto_resize)
    if picture.size != (w, h):
        picture = picture.resize((w, h), resample=Image.LANCZOS)
    pixels = np.asarray(picture, np.float32) / 255.0 * 2.0 - 1.0
    return pixels.transpose(2, 0, 1)[None]


def reference_positions(height: int, width: int) -> np.ndarray:
    """RoPE ids of a reference latent's packed tokens: (1, row, col)."""
    ids = latent_ops.image_positions(height, width)
    ids[:, 0] = 1.0
    return ids


class FluxKontextPipeline(FluxPipeline):
    """FLUX.1 Kontext on a mesh: a :class:`FluxPipeline` whose calls take a reference ``image``.

    Args (beyond :class:`FluxPipeline`'s):
      encode_image: pixels [1, 3, H, W] in [-1, 1] -> the transformer's latents [1, C, H/f, W/f]
        (scaled and shifted); without it the call takes no picture.
    """

    # Its PipeFusion caches (FLUX.1's pipefusion_caches): a skipped step embeds the patch's reference chunk
    # with its image (tests/test_flux_kontext.py).
    #: ``max_area`` and ``auto_resize`` are Kontext's alone (``jaxdit generate --max_area / --no_auto_resize``).
    call_options = (
        CallOption("max_area", "output pixels (default 1048576)", type=int),
        CallOption(
            "auto_resize",
            "keep the reference image's size instead of its preferred resolutions",
            flag="no_auto_resize",
            value=False,
        ),
    )

    def __init__(self, model: Any, mesh: Mesh, *, encode_image: Callable | None = None, **options: Any):
        super().__init__(model, mesh, **options)
        self.encode_image = encode_image

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        parallel: ParallelConfig | Mesh | None = None,
        dtype: Any = None,
        *,
        transformer: str | os.PathLike[str] | None = None,
        transformer_config: Any = None,
        encoder_device: jax.Device | None = None,
        kernel: dict[str, Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
        attention_backend: str | None = None,
        fp8: str | None = None,
        offload_encoders: bool = False,
    ) -> FluxKontextPipeline:
        """A downloaded ``FluxKontextPipeline`` folder on the mesh of ``parallel`` (see
        :meth:`FluxPipeline.from_pretrained`). ``transformer``: the Kontext transformer from another
        checkpoint instead of the folder's ``transformer/``: BFL's ``flux1-kontext-dev.safetensors``, a
        ComfyUI file (``model.diffusion_model.`` keys) or a diffusers folder; ``transformer_config``: its
        ``FluxConfig`` where the weights cannot say it (a BFL file whose head_dim is not 128).
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
        weights = Path(transformer) if transformer is not None else folder["transformer"]
        check_transformer(weights, where, CHECKPOINTS, config=transformer_config)
        dtype = as_dtype(dtype)
        encoders = load_flux_text_encoders(
            folder.root,
            dtype=dtype,
            device=encoder_device,
            compiler_options=compiler_options,
            offload=offload_encoders,
        )
        vae = load_flux_vae(folder["vae"], dtype=dtype, compiler_options=compiler_options)
        model = load_model(
            weights, where, dtype, CHECKPOINTS, staged=PipeFusionFlux, config=transformer_config, fp8=fp8
        )
        c = vae.config

        def encode_image(pixels: np.ndarray) -> np.ndarray:
            mean, _ = vae.encode(np.asarray(pixels, vae.dtype), mesh=mesh)  # the posterior's mode
            return (np.asarray(mean, np.float32) - c.shift_factor) * c.scaling_factor

        factor = 2 ** (len(c.block_out_channels) - 1)
        pipe = cls(
            model,
            where,
            scheduler=euler.FlowMatchEulerConfig.from_diffusers(folder.scheduler_config),
            encode=encoders,
            decode=lambda z: np.asarray(vae.decode_latents(z, mesh=mesh)),
            encode_image=encode_image,
            latent_channels=model.config.in_channels // 4,
            vae_scale_factor=factor,
            kernel=kernel,
            compiler_options=compiler_options,
        )
        pipe.default_size = (128 * factor, 128 * factor)  # diffusers: default_sample_size x the VAE factor
        return pipe

    def __call__(
        self,
        image: Any = None,
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
        max_area: int = MAX_AREA,
        auto_resize: bool = True,
        output_type: str = "np",
        progress: bool = True,
        callback: Callable[[int, int], bool | None] | None = None,
        num_pipeline_patch: int | None = None,
        warmup_steps: int | None = None,
        cache: Any = None,
    ) -> GenerationOutput:
        """Edit ``image`` (a PIL image or an [H, W, 3] array; None: text-to-image) as the prompt says.
        ``max_area``: output pixels (the size is rescaled to it); ``auto_resize``: snap the picture to
        Kontext's preferred resolutions (diffusers' ``_auto_resize``). The rest as
        :meth:`FluxPipeline.__call__`."""
        return self.generate(GenerationRequest.of(**{k: v for k, v in locals().items() if k != "self"}))

    def generate(self, request: GenerationRequest) -> GenerationOutput:
        request = self.with_defaults(request)
        area = request.family_arguments.get("max_area")
        area = MAX_AREA if area is None else area
        if not isinstance(area, int) or isinstance(area, bool) or area < 1:
            raise ValueError(f"max_area must be a positive number of pixels, got {area!r}")
        h, w = output_size(request.height, request.width, area, 2 * self.vae_scale_factor)
        if min(h, w) < 1:
            raise ValueError(f"max_area {area} leaves no {request.height}x{request.width} picture")
        return super().generate(request.replace(height=h, width=w))

    def prepare(self, r: GenerationRequest) -> Prepared:
        prepared = super().prepare(r)
        if r.image is None:
            return prepared
        if self.encode_image is None:
            raise ValueError("this pipeline has no VAE encoder: it cannot read a reference image")
        auto = r.family_arguments.get("auto_resize")
        auto = True if auto is None else bool(auto)
        pixels = reference_pixels(r.image, self.vae_scale_factor, auto)
        latent = np.asarray(self.encode_image(pixels), np.float32)  # [1, C, h, w]
        inputs = prepared.inputs
        rows = len(inputs.context["encoder_hidden_states"])  # every request and CFG branch: one picture
        tokens = np.repeat(latent_ops.pack(latent), rows, axis=0)
        context = dict(
            inputs.context,
            reference_hidden_states=tokens,
            reference_ids=reference_positions(*latent.shape[2:]),
        )
        return Prepared(dataclasses.replace(inputs, context=context), prepared.to_latents)
