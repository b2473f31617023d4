"""What ``jaxdit generate`` does, as a library: a request, its checks, and the run.

A request names what to run in one of three ways, each resolved to a model family through the registry
(``jaxdit.families``), never by name here:

- nothing (or ``--model tiny-digits``): the bundled tiny-digits model (a FLUX-architecture preset);
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
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxdit import distributed, runtime
from jaxdit.generate_checks import check_memory, check_request, check_run
from jaxdit.generate_request import TINY, TINY_SIZE, GenerateRequest, load_embeddings
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import tiny_digits as tiny

__all__ = ["GenerateRequest", "TINY", "build", "check_request", "generate", "run", "write"]


# --------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------


def build(r: GenerateRequest, mesh: Any) -> Any:
    """The pipeline of a checked request, on ``mesh``."""
    import jax.numpy as jnp

    from jaxdit.pipelines.flux import tiny_digits

    dtype = jnp.dtype(r.dtype) if r.dtype else None
    pipeline, kernel = r.family.pipeline_class, {"backend": r.attention_backend}
    # Two-expert models only (checked): the other families' builders do not take it.
    options = {"offload_idle_expert": True} if r.offload_idle_expert else {}
    if r.is_tiny:
        pipe = tiny_digits(mesh, kernel=kernel, dtype=dtype)
    elif r.folder is not None:
        pipe = pipeline.from_pretrained(r.folder.root, mesh, dtype, kernel=kernel, **options)
    else:
        preset = None if r.model == TINY else r.model
        pipe = pipeline.from_checkpoint(r.weights, mesh, dtype, preset=preset, kernel=kernel, **options)
    if r.loras:
        pipe.load_lora(r.loras)
    if r.loras_2:  # checked: only two-expert pipelines take it
        pipe.load_lora(r.loras_2, load_into_transformer_2=True)
    return pipe


def generate(pipe: Any, r: GenerateRequest) -> Any:
    """Run the request's call on ``pipe`` (a folder's image, a file's embeddings included)."""
    call = r.call()
    if r.prompt_embeds is not None:
        call = call.replace(**load_embeddings(r.prompt_embeds))
    if r.image is not None:
        from PIL import Image

        call = call.replace(image=np.asarray(Image.open(r.image).convert("RGB")))
    if r.folder is None and not r.is_tiny:
        call = call.replace(output_type="latent")
    return pipe.generate(call)


def write(r: GenerateRequest, result: Any) -> Path:
    """PNG (a grid for several images), MP4/GIF (videos), or the latents as .npy; atomically."""
    from jaxdit.pipelines import output as out

    path = Path(r.output or r.default_output)
    if path.suffix.lower() == ".npy" or result.images is None:
        return out.save_array(path.with_suffix(".npy"), result.latents)
    pixels = out.to_uint8(result.images)
    if r.family.makes_video:
        return out.save_video(path, list(pixels[0]), fps=r.family.video_fps(r.folder))
    columns = 10 if r.is_tiny else 4
    picture = out.grid(pixels, columns=min(columns, len(pixels))) if len(pixels) > 1 else pixels[0]
    return out.save_image(path, picture, scale=8 if r.is_tiny else 1)


def start_devices(r: GenerateRequest) -> None:
    """Emulated devices and the process group, before anything touches a device."""
    if r.emulate_devices:
        runtime.emulate_cpu_devices(r.emulate_devices)
    if r.process_group is not None:
        distributed.join(r.process_group, initialization_timeout_seconds=r.initialization_timeout)


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
    mesh = parallel.make_mesh(devices[: parallel.num_devices])
    # A folder: its path; a checkpoint: the preset it was checked against, else its path.
    label = r.model if r.is_tiny or (r.folder is None and r.model != TINY) else r.weights
    if r.is_tiny and tiny.parse_prompt(r.tiny_prompt) == [tiny.NULL_LABEL]:  # "", "  ", ",,"
        say(
            "tiny-digits: the empty prompt asks for no digit: one unconditional sample (the judge does not apply)"
        )
    say(f"{label}: {parallel.describe()} on {parallel.num_devices} {devices[0].platform} device(s)")
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
    if r.compare_single_device:
        single_mesh = ParallelConfig().make_mesh(jax.local_devices()[:1])
        one = dataclasses.replace(r, **_single_device_degrees())
        single = generate(build(one, single_mesh), one)
        pick = lambda x: x.images if x.images is not None else x.latents
        say(f"max |difference| to the single-device result: {np.abs(pick(single) - pick(result)).max():.2e}")
        if result.cache is not None:
            same = np.array_equal(single.cache.ran, result.cache.ran)
            say(f"cache decisions {'the same as' if same else 'DIFFERENT from'} the single-device run's")
    if not main:
        return 0
    if r.is_tiny:
        _judge(r, result)
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


def _judge(r: GenerateRequest, result: Any) -> None:
    """tiny-digits: how many pictures a held-out classifier reads as the digit asked for. The judge is
    scikit-learn's (a test dependency): without it the run says so and writes its output all the same."""
    from jaxdit.pipelines.digits import DigitJudge

    labels = np.asarray(tiny.parse_prompt(r.tiny_prompt))
    if result.images.shape[1:3] != (TINY_SIZE, TINY_SIZE):
        print(f"the held-out digit judge reads {TINY_SIZE}x{TINY_SIZE} pictures: not run at this size")
    elif (labels != tiny.NULL_LABEL).all():
        try:
            judge = DigitJudge()
        except ImportError as e:
            print(f"the held-out digit judge needs scikit-learn ({e}): not run")
            return
        judged = judge.predict(result.images)
        print(f"held-out digit judge recognises {int((judged == labels).sum())} of {len(labels)} as asked")
