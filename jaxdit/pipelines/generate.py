"""What ``jaxdit generate`` does, as a library: a request, its checks, and the run.

Everything that can be wrong with a request (degrees, CFG without a negative, sizes the patches do not
divide, PipeFusion options without PipeFusion) is reported by :func:`check_request` before jax starts,
weights load or anything compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import numpy as np

TINY = "tiny-digits"
FLUX_PRESETS = ("flux-dev", "flux-schnell")
#: Wan 2.1 models; --weights names the checkpoint, which must be the preset's architecture.
WAN_PRESETS = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.1-i2v-14b")
#: The arrays a Wan --prompt_embeds file may hold (I2V: CLIP image features and the condition latent).
WAN_EMBEDDINGS = ("prompt_embeds", "negative_prompt_embeds", "image_embeds", "condition")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    model: str = TINY
    weights: str | None = None
    prompt: str | None = None
    negative_prompt: str | None = None
    prompt_embeds: str | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None  # default: 3.5 (FLUX-dev's embedded guidance), 5.0 (Wan's CFG)
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
    num_frames: int | None = None  # Wan
    flow_shift: float | None = None  # Wan
    image: str | None = None  # Wan I2V from a pipeline folder: the first frame
    max_sequence_length: int | None = None  # text encoder tokens (pipeline folders; default the encoder's)
    attention_backend: str = "auto"  # auto, xla, cudnn, triton, splash (jaxdit.parallel.kernels)

    @classmethod
    def from_args(cls, args: Any) -> GenerateRequest:
        return cls(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        )

    # Defaults that depend on the model.
    @property
    def is_tiny(self) -> bool:
        return self.model == TINY and self.weights is None

    @functools.cached_property
    def folder_kind(self) -> str | None:
        """flux / wan-t2v / wan-i2v when --weights is a whole pipeline folder (see generate_folder)."""
        from jaxdit.pipelines.generate_folder import is_pipeline_folder
        from jaxdit.pipelines.model_folder import open_model_folder

        if not is_pipeline_folder(self.weights):
            return None
        try:
            return open_model_folder(self.weights).kind
        except ValueError:
            return "unreadable"  # check_request reports the folder's problem

    @property
    def is_wan(self) -> bool:
        return self.model in WAN_PRESETS or self.folder_kind in ("wan-t2v", "wan-i2v")

    @property
    def frames(self) -> int:
        return 81 if self.num_frames is None else self.num_frames

    @property
    def guidance(self) -> float:
        if self.guidance_scale is not None:
            return self.guidance_scale
        return 5.0 if self.is_wan else 3.5

    @property
    def size(self) -> tuple[int, int]:
        if self.is_wan:  # diffusers' WanPipeline defaults (480p)
            return (480 if self.height is None else self.height, 832 if self.width is None else self.width)
        default = 16 if self.is_tiny else 1024
        pick = lambda v: default if v is None else v
        return pick(self.height), pick(self.width)

    @property
    def steps(self) -> int:
        if self.num_inference_steps is not None:
            return self.num_inference_steps
        if self.is_wan:
            return 50
        return 20 if self.is_tiny else 28

    @property
    def cfg_scale(self) -> float:
        if self.true_cfg_scale is not None:
            return self.true_cfg_scale
        return 3.0 if self.is_tiny else 1.0

    @property
    def negative(self) -> str | None:
        # The tiny model's empty prompt is its unconditional branch; CFG is on by default there.
        return "" if self.is_tiny and self.negative_prompt is None else self.negative_prompt

    def sampling_kwargs(self) -> dict[str, Any]:
        """The pipeline call's size and sampling arguments (FLUX's or Wan's), for every way of running."""
        height, width = self.size
        kwargs = dict(
            height=height,
            width=width,
            num_inference_steps=self.steps,
            guidance_scale=self.guidance,
            seed=self.seed,
        )
        if self.is_wan:
            return dict(kwargs, num_frames=self.frames, flow_shift=self.flow_shift)
        return dict(kwargs, true_cfg_scale=self.cfg_scale)

    def parallel_degrees(self) -> dict[str, int]:
        return dict(
            data=self.data_parallel_degree,
            cfg=2 if self.use_cfg_parallel else 1,
            pipefusion=self.pipefusion_parallel_degree,
            ring=self.ring_degree,
            ulysses=self.ulysses_degree,
            tensor=self.tensor_parallel_degree,
        )


def check_request(r: GenerateRequest) -> None:
    """Raise ValueError naming the problem; needs no devices."""
    from jaxdit.mesh import ParallelConfig
    from jaxdit.parallel.kernels import check_backend

    check_backend(r.attention_backend)

    if r.model not in (TINY, *FLUX_PRESETS, *WAN_PRESETS) and r.weights is None:
        raise ValueError(
            f"unknown --model {r.model!r}; use tiny-digits, flux-dev or flux-schnell (with --weights), "
            f"or {', '.join(WAN_PRESETS)} (with --weights)"
        )
    if r.is_wan and r.weights is None:
        raise ValueError(
            f"--model {r.model} needs --weights (a diffusers or original Wan 2.1 folder, or a jaxdit orbax folder)"
        )
    if r.model in FLUX_PRESETS and r.weights is None:
        raise ValueError(
            f"--model {r.model} needs --weights (a BFL file, diffusers folder or jaxdit orbax folder)"
        )
    degrees = r.parallel_degrees()
    config = ParallelConfig(**degrees)  # degrees >= 1
    if config.pipefusion > 1 and r.model not in (TINY, *FLUX_PRESETS, *WAN_PRESETS):
        raise ValueError(
            f"--pipefusion_parallel_degree {config.pipefusion}: jaxdit's PipeFusion runs FLUX models "
            f"(tiny-digits, flux-dev, flux-schnell) and Wan 2.1 ({', '.join(WAN_PRESETS)}); use "
            "--ulysses_degree / --ring_degree / --use_cfg_parallel"
        )
    if config.pipefusion == 1 and (r.num_pipeline_patch is not None or r.warmup_steps is not None):
        raise ValueError(
            "--num_pipeline_patch and --warmup_steps apply to PipeFusion (--pipefusion_parallel_degree > 1)"
        )
    if r.emulate_devices is not None:
        if r.emulate_devices < 1:
            raise ValueError(f"--emulate_devices must be >= 1, got {r.emulate_devices}")
        config.validate_devices(r.emulate_devices)
    if r.folder_kind is not None:
        from jaxdit.pipelines import generate_folder

        generate_folder.check(r, config)
        return
    if r.image is not None or r.max_sequence_length is not None:
        raise ValueError(
            "--image and --max_sequence_length need a pipeline folder as --weights (text encoders)"
        )
    if r.is_wan:
        return _check_wan(r, config)
    if r.num_frames is not None or r.flow_shift is not None:
        raise ValueError(f"--num_frames and --flow_shift apply to Wan models ({', '.join(WAN_PRESETS)})")
    if r.use_cfg_parallel and (r.negative is None and r.prompt_embeds is None or r.cfg_scale <= 1.0):
        raise ValueError(
            "--use_cfg_parallel needs classifier-free guidance: a --negative_prompt (or negative embeddings) and "
            f"--true_cfg_scale > 1 (got {r.cfg_scale}); FLUX-dev's embedded guidance needs no CFG"
        )
    height, width = r.size
    factor = 2 if r.is_tiny else 16
    if height % factor or width % factor or height < factor or width < factor:
        raise ValueError(f"height and width must be positive multiples of {factor}; got {height}x{width}")
    if r.steps < 1:
        raise ValueError(f"--num_inference_steps must be >= 1, got {r.steps}")
    if config.pipefusion > 1:
        # A packed token covers `factor` pixels in each direction (tiny: 2x2 pixels; FLUX: 2x2 latents of 8).
        _check_pipefusion(r, config, height // factor, width // factor)
    if r.is_tiny:
        from jaxdit.pipelines.tiny_digits import CONFIG, parse_prompt

        config.validate_heads(CONFIG.num_heads)
        parse_prompt(r.prompt or "0123456789")
        if r.prompt_embeds is not None:
            raise ValueError("tiny-digits takes digit prompts, not --prompt_embeds")
    elif r.prompt_embeds is None:
        raise ValueError(
            "FLUX needs --prompt_embeds (a .npz/.safetensors with prompt_embeds and pooled_prompt_embeds) until "
            "text encoders land"
        )
    if r.output is not None and Path(r.output).suffix.lower() not in (".png", ".npy"):
        raise ValueError(f"--output must end in .png (images) or .npy (latents); got {r.output}")


def _check_pipefusion(r: GenerateRequest, config, rows: int, cols: int) -> None:
    """PipeFusion's options against the degrees and the latent: M >= P patches of whole rows that the
    sequence degree splits, 1 <= warmup_steps <= steps."""
    from jaxdit.parallel.pipefusion import validate_pipefusion
    from jaxdit.pipelines.pipefusion_flux import default_num_patches, validate_patches

    patches = r.num_pipeline_patch
    if patches is None:
        patches = default_num_patches(config.pipefusion, rows)
    warmup = 1 if r.warmup_steps is None else r.warmup_steps
    validate_pipefusion(config.pipefusion, patches, warmup, r.steps)
    validate_patches(rows, cols, patches, config.sequence_degree)


def _embedding_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the arrays in a .npz / .safetensors file (numpy only: no jax)."""
    if not Path(path).is_file():
        raise ValueError(f"--prompt_embeds {path}: no such file")
    if path.endswith(".npz"):
        with np.load(path) as f:
            return {k: f[k].shape for k in f.files}
    from converters.safetensors_io import open_checkpoint

    ckpt = open_checkpoint(path)
    return {k: tuple(ckpt.shape(k)) for k in ckpt}


def _check_wan(r: GenerateRequest, config) -> None:
    """Wan's part of :func:`check_request`: the pipeline's own checks on the preset and the file's shapes."""
    from jaxdit.models.wan import WanConfig
    from jaxdit.pipelines.wan import check_inputs

    if not Path(r.weights).exists():
        raise ValueError(f"--weights {r.weights}: no such file or folder")
    if r.true_cfg_scale is not None:
        raise ValueError(
            "--true_cfg_scale is FLUX's; Wan's classifier-free guidance scale is --guidance_scale"
        )
    if r.prompt is not None or r.negative_prompt is not None:
        raise ValueError(
            "Wan has no text encoder yet: put prompt_embeds / negative_prompt_embeds in --prompt_embeds"
        )
    if r.prompt_embeds is None:
        raise ValueError(
            "Wan needs --prompt_embeds (a .npz/.safetensors with prompt_embeds [B, 512, 4096] and, for "
            "guidance, negative_prompt_embeds) until text encoders land"
        )
    if r.output is not None and Path(r.output).suffix.lower() != ".npy":
        raise ValueError(f"Wan writes latents (.npy) until the VAE lands; got --output {r.output}")
    shapes = _embedding_shapes(r.prompt_embeds)
    unknown = sorted(set(shapes) - set(WAN_EMBEDDINGS))
    if unknown or "prompt_embeds" not in shapes:
        raise ValueError(
            f"{r.prompt_embeds} holds {sorted(shapes)}; a Wan embeddings file holds prompt_embeds and optionally "
            f"{', '.join(WAN_EMBEDDINGS[1:])}" + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    height, width = r.size
    model = WanConfig.preset(r.model)
    plan = check_inputs(
        model,
        dataclasses.replace(config, pipefusion=1),  # PipeFusion's split of the blocks is checked below
        height=height,
        width=width,
        num_frames=r.frames,
        num_inference_steps=r.steps,
        guidance_scale=r.guidance,
        prompt_embeds=shapes["prompt_embeds"],
        negative_prompt_embeds=shapes.get("negative_prompt_embeds"),
        image_embeds=shapes.get("image_embeds"),
        condition=shapes.get("condition"),
        flow_shift=r.flow_shift,
    )
    if config.pipefusion > 1:
        _check_pipefusion_wan(r, config, model, plan.latent_shape)


def _check_pipefusion_wan(r: GenerateRequest, config, model, latent_shape) -> None:
    """Wan PipeFusion: M >= P patches of whole latent rows (after patchify) that ring x ulysses splits,
    blocks to split over the stages, 1 <= warmup_steps <= steps."""
    from jaxdit.models.wan import latent_grid
    from jaxdit.parallel.pipefusion import validate_pipefusion
    from jaxdit.pipelines.pipefusion_wan import default_num_patches, validate_patches

    if model.num_layers < config.pipefusion:
        raise ValueError(
            f"--pipefusion_parallel_degree {config.pipefusion} exceeds the model's {model.num_layers} blocks: "
            "every stage needs at least one block"
        )
    grid = latent_grid(latent_shape, model.patch_size)
    patches = r.num_pipeline_patch
    if patches is None:
        patches = default_num_patches(config.pipefusion, grid, config.sequence_degree)
    warmup = 1 if r.warmup_steps is None else r.warmup_steps
    validate_pipefusion(config.pipefusion, patches, warmup, r.steps)
    validate_patches(grid, patches, config.sequence_degree)


def _load_embeddings(path: str) -> dict[str, np.ndarray]:
    if path.endswith(".npz"):
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    from converters.safetensors_io import open_checkpoint

    ckpt = open_checkpoint(path)
    return {k: ckpt.read(k) for k in ckpt}


def _pipeline(r: GenerateRequest, mesh):
    import jax.numpy as jnp

    from jaxdit.pipelines.flux import FluxPipeline, tiny_digits

    kernel = {"backend": r.attention_backend}
    if r.is_wan:
        dtype = jnp.dtype(r.dtype) if r.dtype else None
        if r.pipefusion_parallel_degree > 1:
            from jaxdit.pipelines.pipefusion_wan import PipeFusionWanPipeline

            return PipeFusionWanPipeline.from_checkpoint(
                r.weights, mesh, dtype, preset=r.model, kernel=kernel
            )
        from jaxdit.pipelines.wan import WanPipeline

        return WanPipeline.from_checkpoint(r.weights, mesh, dtype, preset=r.model, kernel=kernel)
    if r.pipefusion_parallel_degree > 1:
        from jaxdit.pipelines import pipefusion_flux as pf

        if r.is_tiny:
            return pf.tiny_digits(mesh, kernel=kernel)
        dtype = jnp.dtype(r.dtype) if r.dtype else None
        return pf.PipeFusionFluxPipeline(pf.PipeFusionFlux.load(r.weights, mesh, dtype), kernel=kernel)
    if r.is_tiny:
        return tiny_digits(mesh, kernel=kernel)
    from jaxdit.loading import load_params

    _, model = load_params(r.weights, mesh, jnp.dtype(r.dtype) if r.dtype else None)
    return FluxPipeline(model, mesh, kernel=kernel)


def _call(pipe, r: GenerateRequest, output_type: str):
    kwargs = dict(r.sampling_kwargs(), output_type=output_type)
    if r.pipefusion_parallel_degree > 1:
        kwargs.update(num_pipeline_patch=r.num_pipeline_patch, warmup_steps=r.warmup_steps or 1)
    if r.is_wan:
        e = _load_embeddings(r.prompt_embeds)
        return pipe(**{k: e.get(k) for k in WAN_EMBEDDINGS}, **kwargs)
    if r.is_tiny:
        return pipe(r.prompt or "0123456789", negative_prompt=r.negative, **kwargs)
    e = _load_embeddings(r.prompt_embeds)
    return pipe(
        prompt_embeds=e["prompt_embeds"],
        pooled_prompt_embeds=e["pooled_prompt_embeds"],
        negative_prompt_embeds=e.get("negative_prompt_embeds"),
        negative_pooled_prompt_embeds=e.get("negative_pooled_prompt_embeds"),
        **kwargs,
    )


def run(r: GenerateRequest) -> int:
    import jax

    if r.emulate_devices:
        # Must happen before jax's backend starts (nothing above touched devices).
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", r.emulate_devices)
    from jaxdit.mesh import ParallelConfig
    from jaxdit.pipelines import output as out

    config = ParallelConfig(**r.parallel_degrees())
    devices = jax.devices()
    if len(devices) < config.num_devices:
        raise ValueError(
            f"{config.describe()} needs {config.num_devices} devices; {len(devices)} are available"
        )
    mesh = config.make_mesh(devices[: config.num_devices])
    if r.folder_kind is not None:
        from jaxdit.pipelines import generate_folder

        print(f"{r.weights}: {config.describe()} on {config.num_devices} {devices[0].platform} device(s)")
        single = ParallelConfig().make_mesh(devices[:1]) if r.compare_single_device else None
        generate_folder.run(r, mesh, single)
        return 0
    output_type = "np" if r.is_tiny else "latent"
    print(f"{r.model}: {config.describe()} on {config.num_devices} {devices[0].platform} device(s)")
    start = time.perf_counter()
    pipe = _pipeline(r, mesh)
    result = _call(pipe, r, output_type)
    elapsed = time.perf_counter() - start
    print(f"generated in {elapsed:.1f} s ({result.seconds:.1f} s denoising, compile included)")

    if r.compare_single_device:
        single = _call(_pipeline(r, ParallelConfig().make_mesh(devices[:1])), r, output_type)
        diff = float(np.abs(single.latents - result.latents).max())
        print(f"max |difference| to the single-device result: {diff:.2e}")

    if r.is_tiny:
        from jaxdit.pipelines.digits import DigitJudge
        from jaxdit.pipelines.tiny_digits import NULL_LABEL, parse_prompt

        labels = np.asarray(parse_prompt(r.prompt or "0123456789"))
        if (labels != NULL_LABEL).all():
            judged = DigitJudge().predict(result.images)
            print(
                f"held-out digit judge recognises {int((judged == labels).sum())} of {len(labels)} as asked"
            )

    path = Path(r.output or ("digits.png" if r.is_tiny else "latents.npy"))
    if path.suffix.lower() == ".npy" or result.images is None:
        path = path.with_suffix(".npy")
        out.save_array(path, result.latents)
    else:
        images = out.to_uint8(result.images)
        picture = out.grid(images, columns=min(10, len(images))) if len(images) > 1 else images[0]
        out.save_image(path, picture, scale=8 if r.is_tiny else 1)
    print(f"wrote {path}")
    return 0
