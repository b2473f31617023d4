"""The request ``jaxdit generate`` runs: its flags (xDiT's names), what they resolve to (a model family, a
downloaded folder or a checkpoint), and the pipeline call they make, with every unset flag taking the
family pipeline's own call default (diffusers'), read from its signature, so the CLI and the Python API
agree. Reading a request touches no device (jax is not started here).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Any

import numpy as np

from jaxdit import families
from jaxdit.cache import FirstBlockCache, TeaCache
from jaxdit.distributed import ProcessGroup, resolve
from jaxdit.families.base import ModelFamily
from jaxdit.lora import parse_lora
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import preflight
from jaxdit.pipelines import tiny_digits as tiny
from jaxdit.pipelines.model_folder import ModelFolder
from jaxdit.pipelines.request import GenerationRequest

__all__ = ["GenerateRequest", "TINY", "call_defaults", "embedding_shapes", "load_embeddings", "takes"]

TINY = tiny.NAME
#: T5 / umT5 prompt length in FLUX's and Wan's pipelines (diffusers refuses more).
MAX_SEQUENCE_LENGTH = 512
#: Denoising steps of one run at most: the schedulers' training timesteps (more repeat them, and a typo
#: like 1000000000 would run for weeks).
MAX_STEPS = 1000
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
    max_area: int | None = None  # FLUX.1 Kontext: output pixels (default 1024^2, as diffusers)
    no_auto_resize: bool = False  # FLUX.1 Kontext: keep the reference's size (diffusers' _auto_resize=False)
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
        return None if self.prompt_embeds is None else embedding_shapes(self.prompt_embeds)

    @property
    def tiny_prompt(self) -> str:
        """tiny-digits' prompt: all ten digits when none is given; an empty one is the unconditional branch."""
        return "0123456789" if self.prompt is None else self.prompt

    def call(self) -> GenerationRequest:
        """The pipeline call: every unset flag takes the family pipeline's call default (tiny-digits: its
        training record's), so ``jaxdit generate`` and ``pipe(...)`` agree."""
        defaults = call_defaults(self.family.pipeline_class)
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
            max_area=self.max_area,
            auto_resize=False if self.no_auto_resize else None,
            warmup_steps=self.warmup_steps,
            num_pipeline_patch=self.num_pipeline_patch,
            cache=self.cache(),
        )


def call_defaults(pipeline_class: type) -> dict[str, Any]:
    """The defaults a call of ``pipeline_class`` takes (its own, so both ways of asking agree)."""
    return pipeline_class.call_defaults()


def takes(pipeline_class: type, argument: str) -> bool:
    return argument in inspect.signature(pipeline_class.__call__).parameters


def load_embeddings(path: str) -> dict[str, np.ndarray]:
    """The arrays of a .npz / .safetensors embeddings file, proven finite floating-point arrays
    (``preflight.read_embeddings``); read once per run, though the checks and the run ask several times
    (a file changed since is read again)."""
    stat = Path(path).stat() if Path(path).is_file() else None
    return _read_embeddings(path, None if stat is None else (stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=2)
def _read_embeddings(path: str, version: tuple[int, int] | None) -> dict[str, np.ndarray]:
    return preflight.read_embeddings(path)


def embedding_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the arrays in an embeddings file (numpy only: no jax)."""
    return {k: tuple(v.shape) for k, v in load_embeddings(path).items()}
