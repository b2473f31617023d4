"""What ``jaxdit generate`` does, as a library: a request, its checks, and the run.

A request names what to run in one of three ways, each resolved to a model family through the registry
(``jaxdit.families``), never by name here:

- nothing (or ``--model tiny-digits``): the bundled tiny-digits model (a FLUX-architecture preset);
- ``--weights FOLDER``, a whole downloaded pipeline (diffusers layout, or a family's own release
  layout): prompt -> pixels, with the folder's text encoders and VAE;
- ``--model PRESET --weights CHECKPOINT --prompt_embeds FILE``: a transformer checkpoint alone, from
  prompt embeddings to latents (``.npy``).

Everything that can be wrong with a request (degrees, CFG without a negative, sizes the VAE and patches
do not divide, PipeFusion options, the output's suffix) is reported by :func:`check_request` before jax
starts, weights load or anything compiles. Defaults that the flags leave unset are the family
pipeline's own call defaults (diffusers'), read from its signature, so the CLI and the Python API agree.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxdit import distributed, families, runtime
from jaxdit.cache import FirstBlockCache, TeaCache
from jaxdit.distributed import ProcessGroup, resolve
from jaxdit.families.base import ModelFamily
from jaxdit.lora import parse_lora
from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.kernels import check_backend
from jaxdit.pipelines import preflight
from jaxdit.pipelines import tiny_digits as tiny
from jaxdit.pipelines.base import CACHE_WITH_PIPEFUSION
from jaxdit.pipelines.model_folder import ModelFolder
from jaxdit.pipelines.request import GenerationRequest

__all__ = ["GenerateRequest", "check_request", "run"]

TINY = tiny.NAME
#: T5 / umT5 prompt length in FLUX's and Wan's pipelines (diffusers refuses more).
MAX_SEQUENCE_LENGTH = 512
IMAGE_SUFFIXES, VIDEO_SUFFIXES = (".png", ".npy"), (".mp4", ".gif", ".npy")
#: The tiny model's training record fixes its sampling (pixel space, 16 x 16, CFG with the empty prompt).
TINY_SIZE = 16
TINY_DEFAULTS = dict(height=TINY_SIZE, width=TINY_SIZE, num_inference_steps=20, true_cfg_scale=3.0)
#: Bounds on what the bundled model is asked for: it was trained on 16x16 single digits; larger sizes
#: and prompts are allowed for experiments, not without limit (a 4000x4000 request wants ~20 GB).
TINY_MAX_SIZE = 128
TINY_MAX_DIGITS = 64
#: tiny-digits' cache thresholds, measured (scripts/cache_digits.py, README "Feature caching"): with 20
#: steps and 4 blocks First-Block-Cache skips nothing at FLUX.1-dev's 0.08; 0.2 is the smallest tried
#: value that skips over 30% of block evaluations (the judge keeps 100%). TeaCache keeps FLUX's 0.4.
TINY_CACHE_THRESHOLDS = {"fbcache": 0.2}


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """The flags of ``jaxdit generate`` (xDiT's names); None means "the model's default"."""

    model: str = TINY
    weights: str | None = None
    prompt: str | None = None
    negative_prompt: str | None = None
    prompt_embeds: str | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None  # Wan 2.2 A14B: the low-noise expert's
    true_cfg_scale: float | None = None
    seed: int = 0
    output: str | None = None
    emulate_devices: int | None = None
    compare_single_device: bool = False
    dtype: str | None = None
    data_parallel_degree: int = 1
    use_cfg_parallel: bool = False
    ulysses_degree: int = 1
    ring_degree: int = 1
    tensor_parallel_degree: int = 1
    pipefusion_parallel_degree: int = 1
    num_pipeline_patch: int | None = None
    warmup_steps: int | None = None
    num_frames: int | None = None  # video families
    flow_shift: float | None = None  # Wan
    image: str | None = None  # image-to-video (pipeline folders): the first frame
    max_sequence_length: int | None = None  # text encoder tokens (pipeline folders)
    lora: tuple[str, ...] = ()  # LoRA files, each FILE or FILE:SCALE
    lora_2: tuple[str, ...] = ()  # Wan 2.2 A14B: LoRA files for the low-noise expert (transformer_2)
    attention_backend: str = "auto"  # auto, xla, cudnn, triton, splash (jaxdit.parallel.kernels)
    # Several processes (hosts): jaxdit.distributed; None falls back to JAXDIT_* / a launcher's variables.
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout: float = 300.0
    use_fbcache: bool = False  # First-Block-Cache
    use_teacache: bool = False  # TeaCache
    cache_threshold: float | None = None  # default: TINY_CACHE_THRESHOLDS, else the cache's own
    offload_idle_expert: bool = False  # Wan 2.2 A14B: the idle expert waits in host memory

    @classmethod
    def from_args(cls, args: Any) -> GenerateRequest:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        values["lora"] = tuple(values.get("lora") or ())
        values["lora_2"] = tuple(values.get("lora_2") or ())
        return cls(**values)

    @functools.cached_property
    def loras(self) -> list[tuple[str, float]]:
        """``--lora FILE[:SCALE]`` as (path, scale) pairs (the scale defaults to 1)."""
        return [parse_lora(arg) for arg in self.lora]

    @functools.cached_property
    def loras_2(self) -> list[tuple[str, float]]:
        """``--lora_2 FILE[:SCALE]`` (the low-noise expert's) as (path, scale) pairs."""
        return [parse_lora(arg, "--lora_2") for arg in self.lora_2]

    # ------------------------------------------------------------------ what runs
    @property
    def is_tiny(self) -> bool:
        return self.model == TINY and self.weights is None

    @functools.cached_property
    def folder(self) -> ModelFolder | None:
        """The downloaded pipeline folder ``--weights`` names, if it is one (None for a checkpoint)."""
        if not families.is_pipeline_folder(self.weights):
            return None
        return families.open_folder(self.weights)[1]

    @functools.cached_property
    def family(self) -> ModelFamily:
        if self.is_tiny:
            return families.FLUX
        if self.folder is not None:
            return families.get(self.folder.family)
        if self.model != TINY:
            return families.preset(self.model)[0]
        return families.detect_family(self.weights)  # a checkpoint without --model: its headers say

    @property
    def default_output(self) -> str:
        if self.is_tiny:
            return "digits.png"
        if self.folder is None:
            return "latents.npy"
        return "video.mp4" if self.family.makes_video else "image.png"

    @functools.cached_property
    def process_group(self) -> ProcessGroup | None:
        """The processes to join (``jaxdit.distributed.resolve``), or None for one process."""
        return resolve(self.coordinator, self.num_processes, self.process_id)

    def parallel(self) -> ParallelConfig:
        return ParallelConfig(
            data=self.data_parallel_degree,
            cfg=2 if self.use_cfg_parallel else 1,
            pipefusion=self.pipefusion_parallel_degree,
            ring=self.ring_degree,
            ulysses=self.ulysses_degree,
            tensor=self.tensor_parallel_degree,
        )

    # ------------------------------------------------------------------ the call
    def cache(self) -> Any:
        """The feature cache the flags ask for (``jaxdit.cache``), or None."""
        kind = FirstBlockCache if self.use_fbcache else TeaCache if self.use_teacache else None
        if kind is None:
            return None
        threshold = self.cache_threshold
        if threshold is None and self.is_tiny:
            threshold = TINY_CACHE_THRESHOLDS.get(kind.name)
        return kind() if threshold is None else kind(threshold=threshold)

    @functools.cached_property
    def embeddings(self) -> dict[str, tuple[int, ...]] | None:
        """Names and shapes of the arrays in the ``--prompt_embeds`` file (read without jax)."""
        return None if self.prompt_embeds is None else _embedding_shapes(self.prompt_embeds)

    @property
    def tiny_prompt(self) -> str:
        """tiny-digits' prompt: all ten digits when none is given; an empty one is the unconditional branch."""
        return "0123456789" if self.prompt is None else self.prompt

    def call(self) -> GenerationRequest:
        """The pipeline call: every unset flag takes the family pipeline's call default (tiny-digits: its
        training record's), so ``jaxdit generate`` and ``pipe(...)`` agree."""
        defaults = _call_defaults(self.family.pipeline_class)
        if self.is_tiny:
            defaults.update(TINY_DEFAULTS)
        pick = lambda name, value: defaults.get(name) if value is None else value
        negative = self.negative_prompt
        if self.is_tiny and negative is None:
            negative = ""  # the tiny model's empty prompt is its unconditional branch: CFG by default
        return GenerationRequest(
            prompt=self.tiny_prompt if self.is_tiny else self.prompt,
            negative_prompt=negative,
            height=pick("height", self.height),
            width=pick("width", self.width),
            num_frames=pick("num_frames", self.num_frames),
            num_inference_steps=pick("num_inference_steps", self.num_inference_steps),
            guidance_scale=pick("guidance_scale", self.guidance_scale),
            guidance_scale_2=self.guidance_scale_2,
            true_cfg_scale=pick("true_cfg_scale", self.true_cfg_scale),
            flow_shift=self.flow_shift,
            seed=self.seed,
            max_sequence_length=self.max_sequence_length,
            warmup_steps=self.warmup_steps,
            num_pipeline_patch=self.num_pipeline_patch,
            cache=self.cache(),
        )


def _call_defaults(pipeline_class: type) -> dict[str, Any]:
    signature = inspect.signature(pipeline_class.__call__)
    return {
        name: p.default
        for name, p in signature.parameters.items()
        if p.default is not inspect.Parameter.empty and p.default is not None
    }


def _takes(pipeline_class: type, argument: str) -> bool:
    return argument in inspect.signature(pipeline_class.__call__).parameters


def _load_embeddings(path: str) -> dict[str, np.ndarray]:
    """The arrays of a .npz / .safetensors embeddings file, proven finite floating-point arrays
    (``preflight.read_embeddings``); read once per run, though the checks and the run ask several times
    (a file changed since is read again)."""
    stat = Path(path).stat() if Path(path).is_file() else None
    return _read_embeddings(path, None if stat is None else (stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=2)
def _read_embeddings(path: str, version: tuple[int, int] | None) -> dict[str, np.ndarray]:
    return preflight.read_embeddings(path)


def _embedding_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the arrays in an embeddings file (numpy only: no jax)."""
    return {k: tuple(v.shape) for k, v in _load_embeddings(path).items()}


# --------------------------------------------------------------------------------------------------------
# Checks (no jax)
# --------------------------------------------------------------------------------------------------------


def check_request(r: GenerateRequest) -> None:
    """Raise ValueError naming the problem; needs no devices."""
    check_backend(r.attention_backend)
    known = families.presets()
    if r.weights is None and r.model != TINY:
        if r.model not in known:
            raise ValueError(
                f"unknown --model {r.model!r}; use tiny-digits (bundled, the default) or, with --weights, "
                f"one of {', '.join(known)}"
            )
        raise ValueError(
            f"--model {r.model} needs --weights (a {known[r.model][0].display} checkpoint or pipeline folder)"
        )
    parallel = r.parallel()  # every degree >= 1
    if parallel.pipefusion == 1 and (r.num_pipeline_patch is not None or r.warmup_steps is not None):
        raise ValueError(
            "--num_pipeline_patch and --warmup_steps apply to PipeFusion (--pipefusion_parallel_degree > 1)"
        )
    group = r.process_group  # the process flags, checked
    if r.initialization_timeout <= 0:
        raise ValueError(f"--initialization_timeout must be > 0 seconds, got {r.initialization_timeout}")
    _check_cache(r, parallel)
    if r.emulate_devices is not None:
        runtime.check_emulated_devices(r.emulate_devices)
        # Emulated devices are per process; the mesh spans every process's.
        parallel.validate_devices(r.emulate_devices * ((group.num_processes or 1) if group else 1))
    for name in ("guidance_scale", "guidance_scale_2", "true_cfg_scale", "flow_shift"):
        value = getattr(r, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"--{name} must be a finite number, got {value}")
    if r.folder is not None:
        _check_folder(r)
    elif r.image is not None or r.max_sequence_length is not None:
        raise ValueError(
            "--image and --max_sequence_length need a pipeline folder as --weights (text encoders)"
        )
    elif not r.is_tiny:
        _check_checkpoint(r)
    else:
        _check_tiny(r)
    _check_call(r, parallel)


def _check_cache(r: GenerateRequest, parallel: ParallelConfig) -> None:
    if r.use_fbcache and r.use_teacache:
        raise ValueError("--use_fbcache and --use_teacache are two caches: pick one")
    if r.cache_threshold is not None:
        if not (r.use_fbcache or r.use_teacache):
            raise ValueError("--cache_threshold needs a cache: add --use_fbcache or --use_teacache")
        if not math.isfinite(r.cache_threshold) or r.cache_threshold <= 0:
            raise ValueError(f"--cache_threshold must be a positive number, got {r.cache_threshold}")
    if (r.use_fbcache or r.use_teacache) and parallel.pipefusion > 1:
        raise ValueError(
            f"--pipefusion_parallel_degree {parallel.pipefusion} with a cache: {CACHE_WITH_PIPEFUSION}"
        )


def _check_tiny(r: GenerateRequest) -> None:
    digits = tiny.parse_prompt(r.tiny_prompt)
    if len(digits) > TINY_MAX_DIGITS:
        raise ValueError(
            f"tiny-digits draws at most {TINY_MAX_DIGITS} digits per run; the prompt has {len(digits)}"
        )
    if r.prompt_embeds is not None:
        raise ValueError("tiny-digits takes digit prompts, not --prompt_embeds")
    for name in ("height", "width"):
        value = getattr(r, name)
        if value is not None and value > TINY_MAX_SIZE:
            raise ValueError(
                f"tiny-digits was trained on {TINY_SIZE}x{TINY_SIZE} pictures; --{name} {value} is "
                f"beyond the {TINY_MAX_SIZE} pixels it is allowed to try"
            )


def _check_folder(r: GenerateRequest) -> None:
    """``--model`` is optional with a folder (the folder says what it is); a preset given must be of the
    folder's family and kind (its exact architecture is not compared)."""
    folder, family = r.folder, r.family
    if r.model != TINY:
        owner, preset = families.preset(r.model) if r.model in families.presets() else (None, None)
        if owner is not family or preset.kind != folder.kind:
            raise ValueError(
                f"--model {r.model} does not match {r.weights}, a {family.display} folder ({folder.kind})"
            )
    if r.prompt is None:
        raise ValueError(f"{r.weights} is a whole pipeline: give --prompt (its text encoders encode it)")
    if r.prompt_embeds is not None:
        raise ValueError("--prompt_embeds and a pipeline folder: the folder's text encoders encode --prompt")
    takes_image = family.image_input(folder)
    if takes_image == "required" and r.image is None:
        raise ValueError(f"{r.weights} is an image-to-video model: give --image (the first frame)")
    if takes_image == "none" and r.image is not None:
        raise ValueError(f"--image is for image-to-video models; {r.weights} is {folder.kind}")
    if r.image is not None:
        preflight.check_image_file(r.image)
    preflight.check_prompts([p for p in (r.prompt, r.negative_prompt) if p is not None])
    if r.max_sequence_length is not None and not 1 <= r.max_sequence_length <= MAX_SEQUENCE_LENGTH:
        raise ValueError(
            f"--max_sequence_length must be in 1..{MAX_SEQUENCE_LENGTH} (the T5 encoders' length), "
            f"got {r.max_sequence_length}"
        )


def _check_checkpoint(r: GenerateRequest) -> None:
    family = r.family
    if not Path(r.weights).exists():
        raise ValueError(f"--weights {r.weights}: no such file or folder")
    if r.prompt is not None or r.negative_prompt is not None:
        raise ValueError(
            f"{r.weights} is a transformer checkpoint without text encoders: put "
            f"{' / '.join(family.embedding_names[:2])} in --prompt_embeds, or give a pipeline folder"
        )
    if r.prompt_embeds is None:
        raise ValueError(
            f"a {family.display} checkpoint needs --prompt_embeds (a .npz/.safetensors with "
            f"{', '.join(family.embedding_names)}), or a whole pipeline folder as --weights"
        )
    shapes = r.embeddings
    unknown = sorted(set(shapes) - set(family.embedding_names))
    if unknown or "prompt_embeds" not in shapes:
        raise ValueError(
            f"{r.prompt_embeds} holds {sorted(shapes)}; a {family.display} embeddings file holds "
            f"{', '.join(family.embedding_names)}" + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )


def _check_call(r: GenerateRequest, parallel: ParallelConfig) -> None:
    """The call's arguments against the family: flags it takes, sizes, CFG, PipeFusion, the output."""
    family, call, pipeline = r.family, r.call(), r.family.pipeline_class
    for flags in (("num_frames", "flow_shift"), ("true_cfg_scale",), ("guidance_scale_2",)):
        if any(getattr(r, f) is not None for f in flags) and not _takes(pipeline, flags[0]):
            owners = " / ".join(
                f.display for f in families.FAMILIES.values() if _takes(f.pipeline_class, flags[0])
            )
            if flags[0] == "guidance_scale_2":
                raise ValueError(f"--guidance_scale_2 applies to {owners} models with two experts")
            if flags[0] == "true_cfg_scale":
                raise ValueError(
                    f"--true_cfg_scale is {owners}'s; {family.display}'s classifier-free guidance scale is "
                    f"--{family.cfg_scale_argument}"
                )
            raise ValueError(f"{' and '.join('--' + f for f in flags)} apply to {owners} models")
    if (
        r.offload_idle_expert
        and "offload_idle_expert" not in inspect.signature(pipeline.from_pretrained).parameters
    ):
        raise ValueError(f"--offload_idle_expert applies to two-expert models; {family.display} has none")
    if r.lora_2 and "load_into_transformer_2" not in inspect.signature(pipeline.load_lora).parameters:
        raise ValueError(
            f"--lora_2 goes into a second (low-noise) expert; {family.display} has one transformer: use --lora"
        )
    if call.num_inference_steps < 1:
        raise ValueError(f"--num_inference_steps must be >= 1, got {call.num_inference_steps}")
    config = _model_config(r)
    # The family's own checks first: with a known model and embeddings they are the pipeline's, whose
    # messages name the nearest valid sizes and frame counts.
    family.check_generate(call_view(r, call), config, parallel)
    multiple = 2 if r.is_tiny else family.size_multiple(r.folder)
    if call.height % multiple or call.width % multiple or min(call.height, call.width) < multiple:
        raise ValueError(
            f"{family.display}: height and width must be positive multiples of {multiple}; "
            f"got {call.height}x{call.width}"
        )
    cfg = _uses_cfg(r, call)
    if parallel.cfg == 2 and not cfg:
        value = getattr(call, family.cfg_scale_argument)
        raise ValueError(
            f"--use_cfg_parallel needs classifier-free guidance: {family.cfg_needs} "
            f"(got --{family.cfg_scale_argument} {value})"
        )
    if config is not None:
        parallel.validate_heads(config.num_heads)
    if config is None and (parallel.pipefusion > 1 or r.lora or r.lora_2) and r.folder is not None:
        config = family.checkpoints.open(r.folder["transformer"], None).config  # config and headers only
    if parallel.pipefusion > 1:
        family.check_pipefusion(call_view(r, call), config, parallel, multiple)
    _check_loras(r, config)
    _check_output(r)


def _uses_cfg(r: GenerateRequest, call: GenerationRequest) -> bool:
    family = r.family
    cfg = getattr(call, family.cfg_scale_argument) > 1.0
    if family.cfg_scale_argument == "true_cfg_scale":
        cfg = cfg and (call.negative_prompt is not None or "negative_prompt_embeds" in (r.embeddings or {}))
    return cfg


def _check_memory(r: GenerateRequest, parallel: ParallelConfig, devices: list) -> None:
    """Refuse, before any weight is read, a request the planner's memory model says cannot fit
    (``jaxdit.plan.fit``). tiny-digits is bounded by its own size limits instead."""
    if r.is_tiny:
        return
    from jaxdit.plan.fit import check_fits
    from jaxdit.plan.workload import Workload

    config = _model_config(r)
    if config is None:
        config = r.family.checkpoints.open(r.folder["transformer"], None).config  # config and headers only
    call = r.call()
    shapes = r.embeddings or {}
    # The workload counts tokens with the family's usual VAE factor; a folder whose VAE has another one
    # is priced at the nearest size that factor divides (the check only refuses what cannot fit).
    multiple = r.family.size_multiple(None)
    up = lambda n: -(-n // multiple) * multiple
    workload = Workload.for_config(
        config,
        height=up(call.height),
        width=up(call.width),
        frames=call.num_frames or 1,
        steps=call.num_inference_steps,
        branches=2 if _uses_cfg(r, call) else 1,
        requests=shapes["prompt_embeds"][0] if "prompt_embeds" in shapes else 1,
        dtype=r.dtype or "bfloat16",
    )
    check_fits(workload, parallel, devices)


def _check_loras(r: GenerateRequest, config: Any) -> None:
    """Every ``--lora`` / ``--lora_2`` file read and checked against the model (layout, family, sizes,
    values) before any weight loads; they are small. Without a known config (a checkpoint without
    --model) the files are checked when the pipeline loads them, still before the first step."""
    from converters.lora import LoraError, read_lora

    for flag, loras in (("--lora", r.loras), ("--lora_2", r.loras_2)):
        for path, _ in loras:
            if not Path(path).exists():
                raise ValueError(f"{flag} {path}: no such file")
            if config is not None:
                try:
                    read_lora(path, config)
                except (LoraError, ValueError) as e:  # which flag (which expert) the file was given to
                    raise type(e)(f"{flag} {e}") from None


def call_view(r: GenerateRequest, call: GenerationRequest) -> Any:
    """The call's arguments plus the request's embeddings (names -> shapes), for family checks."""
    return _CallView(call, r)


@dataclasses.dataclass(frozen=True)
class _CallView:
    call: GenerationRequest
    request: GenerateRequest

    def __getattr__(self, name: str) -> Any:
        # The request's embeddings, and what a family's checks need from the request beyond the call.
        if name in ("embeddings", "folder", "model", "weights", "offload_idle_expert", "lora_2"):
            return getattr(self.request, name)
        return getattr(self.call, name)


def _model_config(r: GenerateRequest) -> Any:
    if r.is_tiny:
        return tiny.CONFIG
    if r.folder is not None:
        return None  # the folder's transformer's, read only where a check needs it
    if r.model != TINY:
        return r.family.preset_config(r.model)
    return r.family.checkpoint_config(Path(r.weights))  # a checkpoint without --model: its own


def _check_output(r: GenerateRequest) -> None:
    output = r.output or r.default_output
    suffix = Path(output).suffix.lower()
    preflight.check_writable(output)
    if r.folder is None and not r.is_tiny:
        if suffix != ".npy":
            raise ValueError(
                f"a transformer checkpoint alone makes latents: --output must end in .npy; got {output}"
            )
        return
    if r.family.makes_video:
        if suffix not in VIDEO_SUFFIXES:
            raise ValueError(f"--output must end in .mp4 / .gif (video) or .npy (latents); got {output}")
        if suffix == ".mp4" and importlib.util.find_spec("av") is None:
            raise ValueError(
                "writing MP4 needs PyAV: pip install 'jaxdit[video]', or pass --output with .gif (or .npy)"
            )
    elif suffix not in IMAGE_SUFFIXES:
        raise ValueError(f"--output must end in .png (image) or .npy (latents); got {output}")


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
        pipe = tiny_digits(mesh, kernel=kernel)
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
        call = call.replace(**_load_embeddings(r.prompt_embeds))
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

    start_devices(r)
    main = distributed.is_main_process()
    say = print if main else lambda *args: None
    parallel = r.parallel()
    devices = jax.devices()
    if len(devices) < parallel.num_devices:
        raise ValueError(
            f"{parallel.describe()} needs {parallel.num_devices} devices; {len(devices)} are available"
        )
    _check_memory(r, parallel, devices[: parallel.num_devices])
    mesh = parallel.make_mesh(devices[: parallel.num_devices])
    # A folder: its path; a checkpoint: the preset it was checked against, else its path.
    label = r.model if r.is_tiny or (r.folder is None and r.model != TINY) else r.weights
    if r.is_tiny and not r.tiny_prompt.strip():
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
    """tiny-digits: how many pictures a held-out classifier reads as the digit asked for."""
    from jaxdit.pipelines.digits import DigitJudge

    labels = np.asarray(tiny.parse_prompt(r.tiny_prompt))
    if result.images.shape[1:3] != (TINY_SIZE, TINY_SIZE):
        print(f"the held-out digit judge reads {TINY_SIZE}x{TINY_SIZE} pictures: not run at this size")
    elif (labels != tiny.NULL_LABEL).all():
        judged = DigitJudge().predict(result.images)
        print(f"held-out digit judge recognises {int((judged == labels).sum())} of {len(labels)} as asked")
