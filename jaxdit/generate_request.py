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
from jaxdit import generate_cache as cache_flags
from jaxdit.distributed import ProcessGroup, resolve
from jaxdit.families.base import ModelFamily
from jaxdit.lora import parse_lora
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import preflight
from jaxdit.pipelines.model_folder import ModelFolder
from jaxdit.pipelines.request import GenerationRequest

__all__ = ["GenerateRequest", "call_defaults", "embedding_shapes", "load_embeddings", "takes"]

#: T5 / umT5 prompt length in FLUX's and Wan's pipelines (diffusers refuses more).
MAX_SEQUENCE_LENGTH = 512
#: Denoising steps of one run at most: the schedulers' training timesteps (more repeat them, and a typo
#: like 1000000000 would run for weeks).
MAX_STEPS = 1000
IMAGE_SUFFIXES, VIDEO_SUFFIXES = (".png", ".npy"), (".mp4", ".gif", ".npy")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """The flags of ``jaxdit generate`` (xDiT's names); None means "the model's default"."""

    model: str | None = None  # a preset or bundled model's name; None: the folder's, or the bundled default
    weights: str | None = None
    #: one prompt, or several (a tuple: ``--prompt`` repeated, one picture each, where the family takes a batch)
    prompt: str | tuple[str, ...] | None = None
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
    #: image-to-video (pipeline folders): the first frame; several (a tuple) for FLUX.2's references; a
    #: path, or pixels [H, W, 3] already read and checked (``jaxdit serve``'s request pictures)
    image: Any = None
    max_sequence_length: int | None = None  # text encoder tokens (pipeline folders)
    #: A family's own flags given (``jaxdit.pipelines.call_options``: its pipeline's ``call_options``), as
    #: (flag name, value) pairs; they become the call's ``family_arguments``.
    family_flags: tuple[tuple[str, Any], ...] = ()
    lora: tuple[str, ...] = ()  # LoRA files, each FILE or FILE:SCALE
    lora_2: tuple[str, ...] = ()  # Wan 2.2 A14B: LoRA files for the low-noise expert (transformer_2)
    attention_backend: str = "auto"  # auto, xla, cudnn, triton, splash (jaxdit.parallel.kernels)
    quantize: str | None = None  # "fp8": the transformer blocks' linear weights in float8_e4m3fn
    fp8_mode: str | None = None  # weight | matmul (jaxdit.models.fp8); default: matmul where GPUs have FP8
    fp8_skip_steps: int = 0  # the first and last N steps on the original (bf16) weights, retained
    #: Block layers left in --dtype (dotted path parts, comma-separated; "none": none); None: the family's
    fp8_keep: str | None = None
    offload_encoders: bool = False  # pipeline folders: encoder weights wait in host memory between prompts
    encoder_on_mesh: bool = False  # pipeline folders (FLUX.2): the text encoder sharded over the mesh
    fsdp: bool = False  # the block stacks' weights sharded over the mesh, gathered per layer (parallel.fsdp)
    # Several processes (hosts): jaxdit.distributed; None falls back to JAXDIT_* / a launcher's variables.
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout: float = 300.0
    use_fbcache: bool = False  # First-Block-Cache (= --cache fbcache)
    use_teacache: bool = False  # TeaCache (= --cache teacache)
    cache_threshold: float | None = None  # default: the family's measured one, else the cache's own
    # The other feature-cache flags (jaxdit.generate_cache).
    feature_cache: str | None = None  # --cache NAME
    taylor_order: int | None = None
    taylorseer_interval: int | None = None
    dbcache_fn: int | None = None
    dbcache_bn: int | None = None
    magcache_ratios: str | None = None
    calibrate_magcache: str | None = None
    teacache_coefficients: str | None = None
    calibrate_teacache: str | None = None
    offload_idle_expert: bool = False  # Wan 2.2 A14B: the idle expert waits in host memory

    @classmethod
    def from_args(cls, args: Any) -> GenerateRequest:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        values["lora"] = tuple(values.get("lora") or ())
        values["lora_2"] = tuple(values.get("lora_2") or ())
        values["family_flags"] = tuple(values.get("family_flags") or ())
        prompts = values.get("prompt")
        if isinstance(prompts, list):  # --prompt repeated: one stays a string, several are a tuple
            values["prompt"] = prompts[0] if len(prompts) == 1 else tuple(prompts)
        images = values.get("image")
        if isinstance(images, list):  # --image repeated: one stays a path, several are a tuple
            values["image"] = images[0] if len(images) == 1 else tuple(images)
        return cls(**values)

    @functools.cached_property
    def loras(self) -> list[tuple[str, float]]:
        """``--lora FILE[:SCALE]`` as (path, scale) pairs (the scale defaults to 1)."""
        return [parse_lora(arg) for arg in self.lora]

    @functools.cached_property
    def loras_2(self) -> list[tuple[str, float]]:
        """``--lora_2 FILE[:SCALE]`` (the low-noise expert's) as (path, scale) pairs."""
        return [parse_lora(arg, "--lora_2") for arg in self.lora_2]

    @property
    def fp8_keep_layers(self) -> tuple[str, ...] | None:
        """``--fp8_keep`` as path parts: None (not given: the family's list), () for "none"."""
        if self.fp8_keep is None:
            return None
        parts = tuple(p.strip() for p in self.fp8_keep.split(",") if p.strip())
        return () if parts == ("none",) else parts

    # ------------------------------------------------------------------ what runs
    @property
    def source(self) -> str:
        """What runs: "bundled" (a model shipped in jaxdit, no --weights), "folder" (a whole downloaded
        pipeline) or "checkpoint" (a transformer alone: embeddings in, latents out)."""
        if self.weights is None:
            return "bundled"
        return "folder" if self.folder is not None else "checkpoint"

    @functools.cached_property
    def folder(self) -> ModelFolder | None:
        """The downloaded pipeline folder ``--weights`` names, if it is one (None for a checkpoint)."""
        if not families.is_pipeline_folder(self.weights):
            return None
        return families.open_folder(self.weights)[1]

    @functools.cached_property
    def family(self) -> ModelFamily:
        if self.weights is None:
            family = families.bundled(self.model)
            if family is None:
                raise ValueError(f"--model {self.model} is not bundled with jaxdit: it needs --weights")
            return family
        if self.folder is not None:
            return families.get(self.folder.family)
        if self.model is not None:
            return families.preset(self.model)[0]
        return families.detect_family(self.weights)  # a checkpoint without --model: its headers say

    @property
    def preset_name(self) -> str | None:
        """The preset ``--model`` names (None: no --model, or a bundled model's name)."""
        return None if self.model is None or families.bundled(self.model) else self.model

    @property
    def label(self) -> str:
        """How a run names its model: the bundled model or the preset checked against, else the path."""
        if self.source == "bundled":
            return self.family.name
        if self.source == "checkpoint" and self.preset_name is not None:
            return self.preset_name
        return self.weights

    @property
    def default_output(self) -> str:
        return self.family.default_output(makes_pixels=self.source != "checkpoint")

    @functools.cached_property
    def process_group(self) -> ProcessGroup | None:
        """The processes to join (``jaxdit.distributed.resolve``), or None for one process."""
        return resolve(self.coordinator, self.num_processes, self.process_id)

    def agreement(self) -> dict[str, Any]:
        """The flags every process of one run must share (all but who it is, where it joins and how long
        it waits): compared at the roll call, before any device work (``jaxdit.distributed.join``)."""
        own = {"coordinator", "num_processes", "process_id", "initialization_timeout", "output"}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in own}

    def parallel(self) -> ParallelConfig:
        return ParallelConfig(
            data=self.data_parallel_degree,
            cfg=2 if self.use_cfg_parallel else 1,
            pipefusion=self.pipefusion_parallel_degree,
            ring=self.ring_degree,
            ulysses=self.ulysses_degree,
            tensor=self.tensor_parallel_degree,
            fsdp=self.fsdp,
        )

    # ------------------------------------------------------------------ the call
    def cache(self) -> Any:
        """The feature cache the flags ask for (``jaxdit.cache``), or None."""
        return cache_flags.make_cache(self)

    @functools.cached_property
    def embeddings(self) -> dict[str, tuple[int, ...]] | None:
        """Names and shapes of the arrays in the ``--prompt_embeds`` file (read without jax)."""
        return None if self.prompt_embeds is None else embedding_shapes(self.prompt_embeds)

    def call(self) -> GenerationRequest:
        """The pipeline call: every unset flag takes the family pipeline's call default (a bundled model:
        its training record's), so ``jaxdit generate`` and ``pipe(...)`` agree."""
        defaults = call_defaults(self.family.pipeline_class)
        defaults.update(self.family.generate_defaults(self))
        pick = lambda name, value: defaults.get(name) if value is None else value
        return GenerationRequest(
            prompt=list(self.prompt) if isinstance(self.prompt, tuple) else pick("prompt", self.prompt),
            negative_prompt=pick("negative_prompt", self.negative_prompt),
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
            family_arguments=self.family_arguments(),
            warmup_steps=self.warmup_steps,
            num_pipeline_patch=self.num_pipeline_patch,
            cache=self.cache(),
        )

    def family_arguments(self) -> dict[str, Any]:
        """The call arguments of the family's own flags given (flags it does not declare are refused by
        the checks, and left out here)."""
        given = dict(self.family_flags)
        options = self.family.pipeline_class.call_options
        return {o.name: o.call_value(given[o.flag_name]) for o in options if o.flag_name in given}


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
