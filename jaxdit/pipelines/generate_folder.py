"""``jaxdit generate --weights FOLDER --prompt ...``: prompt to pixels from a downloaded model folder.

When ``--weights`` is a whole pipeline (a diffusers folder with ``model_index.json``, or Wan's original
release folder), the text encoders and the VAE come from the folder too: the prompt is encoded, the
latents denoised on the mesh, and the VAE decodes over the mesh to a PNG (FLUX) or an MP4 (Wan).

:func:`check` runs with the other flag checks, before jax starts: it reads only the folder's JSON files.
The mesh against the transformer's heads is checked when the pipeline is built, before any weight is read.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from jaxdit.pipelines.model_folder import (
    FLUX,
    WAN_I2V,
    WAN_ORIGINAL_T5,
    WAN_ORIGINAL_VAE,
    ModelFolder,
    open_model_folder,
    read_json,
)

__all__ = ["check", "is_pipeline_folder", "run"]

IMAGE_SUFFIXES = (".png", ".npy")
#: T5 / umT5 prompt length in FLUX's and Wan's pipelines (diffusers refuses more).
MAX_SEQUENCE_LENGTH = 512
VIDEO_SUFFIXES = (".mp4", ".gif", ".npy")
DEFAULT_IMAGE, DEFAULT_VIDEO = "image.png", "video.mp4"


def is_pipeline_folder(path: str | None) -> bool:
    """Does ``path`` look like a whole pipeline (as opposed to a transformer checkpoint)?"""
    if path is None or not Path(path).is_dir():
        return False
    root = Path(path)
    return any((root / name).exists() for name in ("model_index.json", WAN_ORIGINAL_VAE, WAN_ORIGINAL_T5))


def _check_preset(r: Any, folder: ModelFolder) -> None:
    """``--model`` is optional with a folder (the folder says what it is); a preset given must name the
    folder's family (FLUX or Wan, and image-to-video or not). Its exact architecture is not compared."""
    from jaxdit.pipelines.generate import FLUX_PRESETS, TINY, WAN_PRESETS

    if r.model == TINY:
        return
    kind = "FLUX.1" if folder.kind == FLUX else "Wan 2.1"
    wanted = FLUX_PRESETS if folder.kind == FLUX else WAN_PRESETS
    if r.model not in wanted:
        raise ValueError(f"--model {r.model} does not match {r.weights}, a {kind} folder ({folder.kind})")
    if (r.model == "wan2.1-i2v-14b") != (folder.kind == WAN_I2V):
        raise ValueError(f"--model {r.model} does not match {r.weights}, a {folder.kind} folder")


def check(r: Any, config: Any) -> ModelFolder:
    """Every problem with a folder request that needs no jax: the folder, the flags, sizes, the output."""
    folder = open_model_folder(r.weights)
    _check_preset(r, folder)
    if r.prompt is None:
        raise ValueError(f"{r.weights} is a whole pipeline: give --prompt (its text encoders encode it)")
    if r.prompt_embeds is not None:
        raise ValueError("--prompt_embeds and a pipeline folder: the folder's text encoders encode --prompt")
    if config.pipefusion > 1:
        raise ValueError(
            "PipeFusion runs from transformer checkpoints with --prompt_embeds; from a pipeline folder use "
            "--ulysses_degree / --ring_degree / --use_cfg_parallel / --tensor_parallel_degree"
        )
    if folder.kind == WAN_I2V and r.image is None:
        raise ValueError(f"{r.weights} is an image-to-video model: give --image (the first frame)")
    if folder.kind != WAN_I2V and r.image is not None:
        raise ValueError(f"--image is for image-to-video models; {r.weights} is {folder.kind}")
    if r.image is not None and not Path(r.image).is_file():
        raise ValueError(f"--image {r.image}: no such file")
    if r.steps < 1:
        raise ValueError(f"--num_inference_steps must be >= 1, got {r.steps}")
    if r.max_sequence_length is not None and not 1 <= r.max_sequence_length <= MAX_SEQUENCE_LENGTH:
        raise ValueError(
            f"--max_sequence_length must be in 1..{MAX_SEQUENCE_LENGTH} (the T5 encoders' length), "
            f"got {r.max_sequence_length}"
        )
    height, width = r.size
    if folder.kind == FLUX:
        _check_flux(r, folder, height, width)
    else:
        _check_wan(r, height, width)
    return folder


def _check_flux(r: Any, folder: ModelFolder, height: int, width: int) -> None:
    if r.num_frames is not None or r.flow_shift is not None:
        raise ValueError("--num_frames and --flow_shift apply to Wan models")
    vae = read_json(folder["vae"] / "config.json")
    factor = 2 ** (len(vae.get("block_out_channels", (0,) * 4)) - 1) * 2  # VAE factor x 2x2 packing
    if height % factor or width % factor or height < factor or width < factor:
        raise ValueError(f"height and width must be positive multiples of {factor}; got {height}x{width}")
    if r.use_cfg_parallel and (r.negative is None or r.cfg_scale <= 1.0):
        raise ValueError(
            "--use_cfg_parallel needs classifier-free guidance: a --negative_prompt and --true_cfg_scale > 1 "
            f"(got {r.cfg_scale}); FLUX-dev's embedded guidance needs no CFG"
        )
    if r.output is not None and Path(r.output).suffix.lower() not in IMAGE_SUFFIXES:
        raise ValueError(f"--output must end in .png (image) or .npy (latents); got {r.output}")


def _check_wan(r: Any, height: int, width: int) -> None:
    if r.true_cfg_scale is not None:
        raise ValueError(
            "--true_cfg_scale is FLUX's; Wan's classifier-free guidance scale is --guidance_scale"
        )
    if height % 16 or width % 16 or height < 16 or width < 16:
        raise ValueError(f"Wan: height and width must be positive multiples of 16; got {height}x{width}")
    if r.frames < 1 or (r.frames - 1) % 4:
        raise ValueError(f"Wan: --num_frames must be 4n + 1 (1, 5, ..., 81); got {r.frames}")
    if r.use_cfg_parallel and r.guidance <= 1.0:
        raise ValueError(f"--use_cfg_parallel needs --guidance_scale > 1 (Wan's CFG), got {r.guidance}")
    if r.output is not None and Path(r.output).suffix.lower() not in VIDEO_SUFFIXES:
        raise ValueError(f"--output must end in .mp4 / .gif (video) or .npy (latents); got {r.output}")
    if Path(r.output or DEFAULT_VIDEO).suffix.lower() == ".mp4" and importlib.util.find_spec("av") is None:
        raise ValueError(
            "writing MP4 needs PyAV: pip install 'jaxdit[video]', or pass --output with .gif (or .npy)"
        )


def build(r: Any, folder: ModelFolder, mesh: Any) -> Any:
    """The pipeline for a checked folder request, on ``mesh``."""
    import jax.numpy as jnp

    from jaxdit.pipelines.flux import FluxPipeline
    from jaxdit.pipelines.wan import WanPipeline

    dtype = jnp.dtype(r.dtype) if r.dtype else None
    cls = FluxPipeline if folder.kind == FLUX else WanPipeline
    return cls.from_pretrained(folder.root, mesh, dtype, attention_backend=r.attention_backend)


def call(pipe: Any, r: Any, folder: ModelFolder) -> Any:
    kwargs = r.sampling_kwargs()
    if r.max_sequence_length is not None:
        kwargs["max_sequence_length"] = r.max_sequence_length
    if folder.kind == FLUX:
        return pipe(r.prompt, negative_prompt=r.negative, **kwargs)
    image = None
    if r.image is not None:
        from PIL import Image

        image = np.asarray(Image.open(r.image).convert("RGB"))
    return pipe(r.prompt, r.negative, image=image, **kwargs)


def write(r: Any, folder: ModelFolder, result: Any) -> Path:
    """PNG (FLUX; a grid for several images) or MP4/GIF (Wan), or the latents as .npy."""
    from jaxdit.pipelines import output as out

    default = DEFAULT_IMAGE if folder.kind == FLUX else DEFAULT_VIDEO
    path = Path(r.output or default)
    if path.suffix.lower() == ".npy":
        return out.save_array(path, result.latents)
    pixels = out.to_uint8(result.images)
    if folder.kind == FLUX:
        picture = out.grid(pixels, columns=min(4, len(pixels))) if len(pixels) > 1 else pixels[0]
        return out.save_image(path, picture)
    return out.save_video(path, list(pixels[0]), fps=16)  # Wan 2.1 is trained at 16 fps


def run(r: Any, mesh: Any, single_device_mesh: Any = None) -> Path:
    """Build, generate, optionally compare with one device, write; prints what it did."""
    import time

    folder = open_model_folder(r.weights)
    start = time.perf_counter()
    pipe = build(r, folder, mesh)
    print(
        f"loaded {folder.root.name} ({folder.kind}, {folder.layout} layout) in {time.perf_counter() - start:.1f} s"
    )
    result = call(pipe, r, folder)
    print(
        f"generated in {time.perf_counter() - start:.1f} s ({result.seconds:.1f} s denoising, compile included)"
    )
    if single_device_mesh is not None:
        single = call(build(r, folder, single_device_mesh), r, folder)
        print(
            f"max |difference| to the single-device result: {np.abs(single.images - result.images).max():.2e}"
        )
    path = write(r, folder, result)
    print(f"wrote {path}")
    return path
