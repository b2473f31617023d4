"""What ``jaxdit generate`` does, as a library: a request, its checks, and the run.

A request names what to run in one of three ways, each resolved to a model family through the registry
(``jaxdit.families``), never by name here:

- nothing (or ``--model tiny-digits``): a bundled model (the registry's ``bundled`` families; tiny-digits
  is one, a FLUX-architecture model);
- ``--weights FOLDER``, a whole downloaded pipeline (diffusers layout, or a family's own release
  layout): prompt -> pixels, with the folder's text encoders and VAE;
- ``--model PRESET --weights CHECKPOINT --prompt_embeds FILE``: a transformer checkpoint alone, from
  prompt embeddings to latents (``.npy``).

Three modules, in the order a run uses them:

- ``generate_request``: :class:`GenerateRequest`, the flags and the pipeline call they make (unset flags
  take the family pipeline's own call defaults, diffusers', so the CLI and the Python API agree);
- ``generate_checks``: :func:`check_request`, everything that can be wrong with a request (degrees, CFG
  without a negative, sizes the VAE and patches do not divide, PipeFusion options, LoRA files, memory,
  the output's suffix), reported before jax starts, weights load or anything compiles;
- this module: the run (devices, the pipeline, the generation, the output written atomically).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxdit import distributed, runtime
from jaxdit import generate_cache as cache_flags
from jaxdit.generate_checks import check_memory, check_request, check_run, model_config
from jaxdit.generate_request import GenerateRequest, load_embeddings
from jaxdit.mesh import DeviceMesh, ParallelConfig

__all__ = ["GenerateRequest", "build", "check_request", "generate", "run", "write"]


# --------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------


def build(r: GenerateRequest, mesh: Any) -> Any:
    """The pipeline of a checked request, on ``mesh``."""
    import jax.numpy as jnp

    dtype = jnp.dtype(r.dtype) if r.dtype else None
    pipeline, kernel = r.family.pipeline_class, {"backend": r.attention_backend}
    # Two-expert models only (checked): the other families' builders do not take it.
    options = {"offload_idle_expert": True} if r.offload_idle_expert else {}
    if r.offload_encoders:  # checked: a pipeline folder
        options["offload_encoders"] = True
    if r.encoder_on_mesh:  # checked: a pipeline folder whose builder takes it
        options["encoder_on_mesh"] = True
    if r.quantize == "fp8":  # checked: the builder takes it
        from jaxdit.models.fp8 import choose_mode
        from jaxdit.models.quantize import FP8

        mode = choose_mode(r.fp8_mode, DeviceMesh.of(mesh).mesh.devices.flat)
        options["fp8"] = FP8(mode, r.fp8_keep_layers, r.fp8_skip_steps)
    if r.source == "bundled":
        pipe = r.family.bundled_pipeline(mesh, kernel=kernel, dtype=dtype, **options)
    elif r.source == "folder":
        pipe = pipeline.from_pretrained(r.folder.root, mesh, dtype, kernel=kernel, **options)
    else:
        pipeline = r.family.checkpoint_pipeline(model_config(r))
        pipe = pipeline.from_checkpoint(
            r.weights, mesh, dtype, preset=r.preset_name, kernel=kernel, **options
        )
    if r.loras:
        pipe.load_lora(r.loras)
    if r.loras_2:  # checked: only two-expert pipelines take it
        pipe.load_lora(r.loras_2, load_into_transformer_2=True)
    return pipe


def generate(pipe: Any, r: GenerateRequest) -> Any:
    """Run the request's call on ``pipe`` (a folder's image, a file's embeddings included)."""
    call = r.call()
    if r.prompt_embeds is not None:
        call = call.with_arguments(**load_embeddings(r.prompt_embeds))
    if r.image is not None:
        call = call.replace(image=call_images(r.image))
    if r.source == "checkpoint":
        call = call.replace(output_type="latent")
    return pipe.generate(call)


def call_images(image: Any) -> Any:
    """``--image``'s value -> the call's: a path read as RGB pixels [H, W, 3], several (a tuple: the
    family takes them, checked) a list of them; pictures already read (``jaxdit serve``'s) as they are."""
    from PIL import Image

    read = lambda p: np.asarray(Image.open(p).convert("RGB")) if isinstance(p, str | os.PathLike) else p  # noqa: E731
    return [read(p) for p in image] if isinstance(image, tuple) else read(image)


def write(r: GenerateRequest, result: Any) -> Path:
    """PNG (a grid for several images), MP4/GIF (videos), or the latents as .npy; atomically."""
    from jaxdit.pipelines import output as out

    path = Path(r.output or r.default_output)
    if path.suffix.lower() == ".npy" or result.images is None:
        return out.save_array(path.with_suffix(".npy"), result.latents)
    pixels = out.to_uint8(result.images)
    if r.family.makes_video:
        return out.save_video(path, list(pixels[0]), fps=r.family.video_fps(r.folder))
    columns = r.family.grid_columns
    picture = out.grid(pixels, columns=min(columns, len(pixels))) if len(pixels) > 1 else pixels[0]
    return out.save_image(path, picture, scale=r.family.grid_scale)


def start_devices(r: GenerateRequest) -> None:
    """Emulated devices and the process group, before anything touches a device."""
    if r.emulate_devices:
        runtime.emulate_cpu_devices(r.emulate_devices)
    if r.process_group is not None:
        distributed.join(
            r.process_group, initialization_timeout_seconds=r.initialization_timeout, agreement=r.agreement()
        )


def run(r: GenerateRequest) -> int:
    """Build, generate, optionally compare with one device, write; prints what it did. Across processes
    every process runs this, and process 0 alone prints and writes."""
    import jax

    check_run(r)  # before any device starts
    start_devices(r)
    main = distributed.is_main_process()
    say = print if main else lambda *args: None
    parallel = r.parallel()
    devices = jax.devices()
    if len(devices) < parallel.num_devices:
        raise ValueError(
            f"{parallel.describe()} needs {parallel.num_devices} devices; {len(devices)} are available"
        )
    check_memory(r, parallel, devices[: parallel.num_devices])
    mesh = parallel.device_mesh(devices[: parallel.num_devices])  # the mesh and its degrees, passed on
    note = r.family.describe_call(r.call())
    if note:
        say(note)
    say(f"{r.label}: {parallel.describe()} on {parallel.num_devices} {devices[0].platform} device(s)")
    start = time.perf_counter()
    pipe = build(r, mesh)
    if r.folder is not None:
        say(
            f"loaded {r.folder.root.name} ({r.folder.kind}, {r.folder.layout} layout) in "
            f"{time.perf_counter() - start:.1f} s"
        )
    result = generate(pipe, r)
    say(
        f"generated in {time.perf_counter() - start:.1f} s ({result.seconds:.1f} s denoising, compile included)"
    )
    if result.cache is not None:
        say(result.cache.describe())
        if main:
            cache_flags.save_calibration(r, result.cache, say)
    if r.compare_single_device:
        single_mesh = ParallelConfig().device_mesh(jax.local_devices()[:1])
        one = dataclasses.replace(r, **_single_device_degrees())
        single = generate(build(one, single_mesh), one)
        pick = lambda x: x.images if x.images is not None else x.latents
        say(f"max |difference| to the single-device result: {np.abs(pick(single) - pick(result)).max():.2e}")
        if result.cache is not None:
            same = np.array_equal(single.cache.ran, result.cache.ran)
            say(f"cache decisions {'the same as' if same else 'DIFFERENT from'} the single-device run's")
    if not main:
        return 0
    r.family.report(r.call(), result, say)
    if r.loras:
        say(f"LoRAs fused: {', '.join(f'{p} x {s:g}' for p, s in r.loras)}")
    if r.loras_2:
        say(f"LoRAs fused into the low-noise expert: {', '.join(f'{p} x {s:g}' for p, s in r.loras_2)}")
    say(f"wrote {write(r, result)}")
    return 0


def _single_device_degrees() -> dict[str, Any]:
    return dict(
        data_parallel_degree=1,
        use_cfg_parallel=False,
        ulysses_degree=1,
        ring_degree=1,
        tensor_parallel_degree=1,
        pipefusion_parallel_degree=1,
        num_pipeline_patch=None,
        warmup_steps=None,
    )
