"""Everything that can be wrong with a ``jaxdit generate`` request, reported before jax starts, weights
load or anything compiles: degrees against devices, the model folder or checkpoint (headers only), the
call's arguments against the family (sizes the VAE and patches divide, CFG, PipeFusion options, caches),
LoRA files, memory per device, and the output path.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import os
from pathlib import Path
from typing import Any

from jaxdit import families, runtime
from jaxdit import generate_cache as cache_flags
from jaxdit.generate_request import (
    IMAGE_SUFFIXES,
    MAX_SEQUENCE_LENGTH,
    MAX_STEPS,
    VIDEO_SUFFIXES,
    GenerateRequest,
    takes,
)
from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.kernels import check_backend
from jaxdit.pipelines import preflight
from jaxdit.pipelines.request import GenerationRequest

__all__ = ["call_view", "check_memory", "check_request", "check_run", "model_config"]

#: PipeFusion's own options given without a PipeFusion mesh (generate and serve refuse it alike).
PIPEFUSION_OPTIONS_ALONE = (
    "--num_pipeline_patch and --warmup_steps apply to PipeFusion (--pipefusion_parallel_degree > 1)"
)


def check_request(r: GenerateRequest, *, output: bool = True) -> None:
    """Raise ValueError naming the problem; needs no devices. ``output=False``: the output path is not
    checked (``jaxdit serve``, which writes no file: its check must not depend on the working folder)."""
    check_backend(r.attention_backend)
    known = families.presets()
    if r.weights is None and families.bundled(r.model) is None:
        if r.model not in known:
            shipped = " / ".join(families.bundled_names())
            raise ValueError(
                f"unknown --model {r.model!r}; use {shipped} (bundled; the default is "
                f"{families.bundled().name}) or, with --weights, one of {', '.join(known)}"
            )
        raise ValueError(
            f"--model {r.model} needs --weights (a {known[r.model][0].display} checkpoint or pipeline folder)"
        )
    if r.weights is not None and r.model is not None and families.bundled(r.model) is not None:
        raise ValueError(f"--model {r.model} is bundled with jaxdit: drop --weights {r.weights}")
    parallel = r.parallel()  # every degree >= 1
    if parallel.pipefusion == 1 and (r.num_pipeline_patch is not None or r.warmup_steps is not None):
        raise ValueError(PIPEFUSION_OPTIONS_ALONE)
    group = r.process_group  # the process flags, checked
    if not (math.isfinite(r.initialization_timeout) and r.initialization_timeout > 0):
        raise ValueError(f"--initialization_timeout must be > 0 seconds, got {r.initialization_timeout}")
    if r.seed < 0:
        raise ValueError(f"--seed must be >= 0 (numpy's generator draws the noise from it), got {r.seed}")
    _check_cache(r, parallel)
    if r.emulate_devices is not None:
        runtime.check_emulated_devices(r.emulate_devices)
        # Emulated devices are per process; the mesh spans every process's.
        parallel.validate_devices(r.emulate_devices * ((group.num_processes or 1) if group else 1))
    for name in ("guidance_scale", "guidance_scale_2", "true_cfg_scale", "flow_shift"):
        value = getattr(r, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"--{name} must be a finite number, got {value}")
    if isinstance(r.prompt, tuple) and (r.folder is None or not r.family.several_prompts):
        raise ValueError(
            f"{r.label} ({r.family.display}) takes one --prompt per run; {len(r.prompt)} were given"
        )
    if r.folder is not None:
        _check_folder(r)
    elif r.image is not None or r.max_sequence_length is not None:
        raise ValueError(
            "--image and --max_sequence_length need a pipeline folder as --weights (text encoders)"
        )
    elif r.source == "checkpoint":
        _check_checkpoint(r)
    _check_call(r, parallel, output)


def _check_cache(r: GenerateRequest, parallel: ParallelConfig) -> None:
    cache_flags.check_flags(r, parallel.pipefusion)


def _check_folder(r: GenerateRequest) -> None:
    """``--model`` is optional with a folder (the folder says what it is); a preset given must be of the
    folder's family and kind (its exact architecture is not compared)."""
    folder, family = r.folder, r.family
    if r.model is not None:
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
        raise ValueError(
            f"--image is for models that take a picture (image-to-video, image editing); {r.weights} is "
            f"{folder.kind}, which takes none"
        )
    if isinstance(r.image, tuple) and takes_image != "several":
        raise ValueError(f"{r.weights} ({folder.kind}) takes one --image; {len(r.image)} were given")
    for path in (r.image,) if not isinstance(r.image, tuple) else r.image:
        if isinstance(path, str | os.PathLike):  # not a picture already read and checked (jaxdit serve's)
            preflight.check_image_file(path)
            _check_picture_size(family, folder, path)
    for flag, prompt in (("--prompt", r.prompt), ("--negative_prompt", r.negative_prompt)):
        if prompt is not None:
            preflight.check_prompts(list(prompt) if isinstance(prompt, tuple) else [prompt], flag)
    limit, why = family.text_token_limit or (MAX_SEQUENCE_LENGTH, "the T5 encoders' length")
    if r.max_sequence_length is not None and not 1 <= r.max_sequence_length <= limit:
        raise ValueError(f"--max_sequence_length must be in 1..{limit} ({why}), got {r.max_sequence_length}")


def _check_picture_size(family: Any, folder: Any, path: str | os.PathLike[str]) -> None:
    """A size the family's pipeline can resize (``ModelFamily.picture_problem``), from the file's header."""
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
    problem = family.picture_problem(folder, width, height)
    if problem:
        raise ValueError(
            f"--image {path} is {width}x{height} pixels, which {folder.root.name} cannot take: {problem}"
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


def _owners(argument: str) -> str:
    """The families whose pipelines take a call argument, for messages (a bundled model is not listed:
    it is one of them)."""
    return " / ".join(
        f.display for f in families.FAMILIES.values() if not f.bundled and takes(f.pipeline_class, argument)
    )


def _check_family_flags(r: GenerateRequest) -> None:
    """A family's own flag given to a family that does not declare it (``jaxdit.pipelines.call_options``)."""
    own = {o.flag_name for o in r.family.pipeline_class.call_options}
    declared = families.call_options()
    for flag, _ in r.family_flags:
        if flag not in own:
            owners = " / ".join(f.display for f in declared[flag][1]) if flag in declared else "no"
            raise ValueError(f"--{flag} applies to {owners} models; {r.family.display} does not take it")


def _check_distilled(r: GenerateRequest, parallel: ParallelConfig) -> None:
    """A second branch's flags given to a guidance-distilled model: one line, the family's."""
    why = r.family.guidance_distilled
    if why is None:
        return
    given = {
        "--negative_prompt": r.negative_prompt is not None,
        "--true_cfg_scale": r.true_cfg_scale is not None,
        "--use_cfg_parallel": parallel.cfg == 2,
    }
    flags = [flag for flag, on in given.items() if on]
    if flags:
        raise ValueError(f"{' / '.join(flags)}: {why}")


def _check_call(r: GenerateRequest, parallel: ParallelConfig, output: bool = True) -> None:
    """The call's arguments against the family: flags it takes, sizes, CFG, PipeFusion, the output."""
    family, call, pipeline = r.family, r.call(), r.family.pipeline_class
    _check_family_flags(r)
    _check_distilled(r, parallel)
    for flags in (("num_frames", "flow_shift"), ("true_cfg_scale",), ("guidance_scale_2",)):
        if any(getattr(r, f) is not None for f in flags) and not takes(pipeline, flags[0]):
            owners = _owners(flags[0])
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
    if call.num_inference_steps > MAX_STEPS:
        raise ValueError(
            f"--num_inference_steps must be at most {MAX_STEPS} (the schedulers' training timesteps; FLUX "
            f"and Wan sample in 4-50), got {call.num_inference_steps}"
        )
    config = model_config(r)
    cache_flags.check_for_family(r, config)  # the family's cache hooks, before any weight loads
    # The family's own checks first: with a known model and embeddings they are the pipeline's, whose
    # messages name the nearest valid sizes and frame counts.
    family.check_generate(call_view(r, call), config, parallel)
    multiple = family.size_multiple(r.folder)
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
    if parallel.pipefusion > 1 and family.staged_model is None:  # before any header is read
        raise ValueError(
            f"--pipefusion_parallel_degree {parallel.pipefusion}: {family.display} has no PipeFusion stage "
            "layout; put the devices on --ulysses_degree / --ring_degree / --tensor_parallel_degree instead"
        )
    if config is None and (parallel.pipefusion > 1 or r.lora or r.lora_2) and r.folder is not None:
        config = family.checkpoints.open(r.folder["transformer"], None).config  # config and headers only
    if parallel.pipefusion > 1:
        family.check_pipefusion(call_view(r, call), config, parallel, multiple)
    _check_loras(r, config)
    if output:
        _check_output(r)


def check_run(r: GenerateRequest) -> None:
    """What ``jaxdit generate`` checks beyond :func:`check_request`, before jax starts: what holds only
    where one run draws its prompt's pictures and every flag came from the user (the HTTP service shares
    check_request, but batches ``n`` pictures per prompt and sets every request's guidance scale)."""
    parallel = r.parallel()
    _check_batch(r, parallel)
    _check_cfg_flags_matter(r)
    check_load_options(r, parallel)
    if r.guidance_scale is not None and (why := _guidance_scale_ignored(r)) is not None:
        raise ValueError(why)


def check_load_options(r: GenerateRequest, parallel: Any) -> None:
    """How the weights are held (``--quantize``, ``--fp8_mode``, ``--offload_encoders``,
    ``--encoder_on_mesh``): what cannot run or would change nothing, refused before anything loads
    (generate and serve)."""
    _check_fp8(r, parallel)
    if r.offload_encoders and r.encoder_on_mesh:
        raise ValueError(
            "--offload_encoders keeps the text encoder on one device; --encoder_on_mesh shards it over "
            "the mesh: give one of them"
        )
    if r.offload_encoders:
        _check_encoder_option(
            r, "offload_encoders", "moves a pipeline folder's text encoders to host memory between prompts"
        )
    if r.encoder_on_mesh:
        _check_encoder_option(r, "encoder_on_mesh", "shards a pipeline folder's text encoder over the mesh")


def _check_encoder_option(r: GenerateRequest, option: str, what: str) -> None:
    """A text-encoder placement option needs a folder's encoder and a builder that takes it."""
    if r.source != "folder":
        raise ValueError(
            f"--{option} {what}; {r.label} runs no text encoder here, so it would change nothing"
        )
    if not _builder_takes(r, option):
        raise ValueError(f"--{option} is not available for {r.label} yet")


def _check_fp8(r: GenerateRequest, parallel: Any) -> None:
    """FP8 combinations that cannot run, refused before anything loads."""
    if r.quantize is None:
        for flag, given in (
            ("fp8_mode", r.fp8_mode),
            ("fp8_keep", r.fp8_keep),
            ("fp8_skip_steps", r.fp8_skip_steps),
        ):
            if given:
                raise ValueError(f"--{flag} {given} applies with --quantize fp8, which is not given")
        return
    _check_fp8_steps(r)
    if parallel.pipefusion > 1:
        raise ValueError(
            "--quantize fp8 runs on meshes without PipeFusion (drop --pipefusion_parallel_degree)"
        )
    if r.lora or r.lora_2:
        raise ValueError(
            "--lora cannot be fused into FP8 weights; fuse it first, then quantize: "
            "jaxdit convert SRC DST --lora FILE --quantize fp8, and generate from DST"
        )
    if not _builder_takes(r, "fp8"):
        raise ValueError(f"--quantize fp8 is not available for {r.label} yet")


def _check_fp8_steps(r: GenerateRequest) -> None:
    """``--fp8_skip_steps`` against the call's steps and the options it does not run with."""
    k = r.fp8_skip_steps
    if k < 0:
        raise ValueError(f"--fp8_skip_steps {k}: expected a count of steps >= 0")
    if not k:
        return
    steps = r.call().num_inference_steps
    if steps is not None and 2 * k > steps:
        raise ValueError(
            f"--fp8_skip_steps {k} runs the first and last {k} steps in bf16, {2 * k} steps, but the run has "
            f"{steps} (--num_inference_steps): use at most {steps // 2}"
        )
    if r.use_fbcache or r.use_teacache or r.feature_cache is not None:
        raise ValueError("--fp8_skip_steps does not run with a feature cache yet (drop one of them)")


def _builder_takes(r: GenerateRequest, option: str) -> bool:
    """Whether the function that builds this run's pipeline takes the keyword ``option``."""
    if r.source == "bundled":
        builder = r.family.bundled_pipeline
    else:
        pipeline = r.family.pipeline_class
        builder = pipeline.from_pretrained if r.source == "folder" else pipeline.from_checkpoint
    return option in inspect.signature(builder).parameters


def _check_cfg_flags_matter(r: GenerateRequest) -> None:
    """True CFG needs both a scale above 1 and a negative prompt: either alone runs one branch and gives
    the picture the run without it gives, so a flag that would change nothing is refused."""
    family = r.family
    if family.cfg_scale_argument != "true_cfg_scale":
        return
    call = r.call()
    negative = call.negative_prompt is not None or "negative_prompt_embeds" in (r.embeddings or {})
    if r.true_cfg_scale is not None and r.true_cfg_scale > 1 and not negative:
        raise ValueError(
            f"--true_cfg_scale {r.true_cfg_scale:g} needs a negative prompt (--negative_prompt, or "
            "negative_prompt_embeds in --prompt_embeds): without one no guidance runs and it changes nothing"
        )
    if r.negative_prompt is not None and call.true_cfg_scale <= 1:
        raise ValueError(
            f"--negative_prompt is used by classifier-free guidance, which --true_cfg_scale {call.true_cfg_scale:g} "
            "turns off: give --true_cfg_scale > 1 (e.g. 4), or drop --negative_prompt"
        )


def takes_guidance_scale(r: GenerateRequest) -> bool:
    """Whether the model reads ``guidance_scale`` (its family says: ``ModelFamily.guidance_scale_ignored``)."""
    return _guidance_scale_ignored(r) is None


def _guidance_scale_ignored(r: GenerateRequest) -> str | None:
    config = model_config(r)
    if config is None:
        config = r.family.checkpoints.open(r.folder["transformer"], None).config  # headers only
    return r.family.guidance_scale_ignored(config, r.label)


def _check_batch(r: GenerateRequest, parallel: ParallelConfig) -> None:
    """The pictures of one run split evenly over ``data`` (each data group draws its share)."""
    if parallel.data == 1:
        return
    if r.source == "checkpoint":
        batch = r.embeddings["prompt_embeds"][0]
    else:
        batch = r.family.prompt_batch(r.call().prompt)
    if batch % parallel.data:
        what = "video(s)" if r.family.makes_video else "picture(s)"
        raise ValueError(
            f"--data_parallel_degree {parallel.data} splits the {what} of a run over {parallel.data} groups "
            f"of devices; this run makes {batch} {what}, which do not split evenly: use a degree that "
            f"divides {batch}, or put the devices on --ulysses_degree / --ring_degree"
        )


def _uses_cfg(r: GenerateRequest, call: GenerationRequest) -> bool:
    negative = "negative_prompt_embeds" in (r.embeddings or {})
    return r.family.uses_cfg(call, r.folder, model_config(r), negative)


def check_memory(r: GenerateRequest, parallel: ParallelConfig, devices: list) -> None:
    """Refuse, before any weight is read, a request the planner's memory model says cannot fit
    (``jaxdit.plan.fit``). A bundled model is bounded by its own size limits instead."""
    if not r.family.checks_memory:
        return
    from jaxdit.plan.fit import check_fits
    from jaxdit.plan.workload import Workload

    config = model_config(r)
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
        # The text tokens the run will have: the embeddings' own, or the prompt's --max_sequence_length.
        text_tokens=shapes["prompt_embeds"][1] if "prompt_embeds" in shapes else r.max_sequence_length,
        dtype=r.dtype or "bfloat16",
        family=r.family,
        fp8=r.quantize == "fp8",
        fp8_retained=r.quantize == "fp8" and r.fp8_skip_steps > 0,
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


def model_config(r: GenerateRequest) -> Any:
    if r.source == "bundled":
        return r.family.bundled_config()
    if r.folder is not None:
        return None  # the folder's transformer's, read only where a check needs it
    if r.preset_name is not None:
        return r.family.preset_config(r.preset_name)
    return r.family.checkpoint_config(Path(r.weights))  # a checkpoint without --model: its own


def _check_output(r: GenerateRequest) -> None:
    if r.output is not None and not r.output.strip():
        raise ValueError("--output is empty; give a file name (or leave the flag out for the default)")
    output = r.output or r.default_output
    suffix = Path(output).suffix.lower()
    preflight.check_writable(output)
    if r.source == "checkpoint":
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
