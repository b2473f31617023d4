"""The device side of the service: the one module that calls the pipelines.

An :class:`Engine` holds one pipeline on its mesh for the life of the server: a bundled model
(tiny-digits), or a downloaded pipeline folder of any registered model family (``jaxdit.families``: FLUX.1 makes
images, Wan videos). It says what it accepts (a :class:`~jaxdit.serve.schema.ModelCard`), which compiled
program a request needs (:meth:`Engine.shape_key`), compiles the served shapes up front
(:meth:`Engine.warm_up`) and runs one generation at a time (:meth:`Engine.generate`), calling back after
every denoising step so the caller can report progress and stop the loop. The rest of the service never
sees a pipeline.

A request becomes exactly the call ``jaxdit generate`` makes for the same flags: the engine fills a
:class:`jaxdit.generate.GenerateRequest` and takes its checks (``check_request``, before anything is
queued) and its call (``GenerateRequest.call``: every field left out takes the model's default).

What a compiled program depends on: the size, the batch (``n``), the frames (videos), the input
pictures' sizes (models that take pictures: their reference tokens; warm-up sends grey ones), whether
classifier-free guidance runs (two branches or one), and the step count's bucket (the sampler's tables are
an argument of the step, padded to a multiple of 64 rows: 1-63 steps share one program, 64-127 the next).
On a PipeFusion mesh the exact step count instead: the pipelined phase is one program whose schedule of
ticks is fixed by its number of steps (its warm-up steps and patches are the server's, fixed at start-up).
Seeds, prompts and guidance values reuse a program. A feature cache (``cache`` in the request, one of
those the server was started to allow) is a program of its own: one per cache and, where the threshold is
decided on the devices (First-Block-Cache, DBCache, TeaCache), per threshold; MagCache and TaylorSeer plan
their steps on the host and hand the plan to the step as data, so every threshold shares one program. On a
PipeFusion mesh only those two run, and the same holds: the pipelined loop runs the plan's full steps,
their count data too (``jaxdit.pipelines.pipefusion.cache``).

PipeFusion reports progress, and can be stopped, after each warm-up step and at the end of its pipelined
phase only (one program for all its steps; see ``jaxdit.pipelines.pipefusion.denoiser``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import math
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxdit import generate as cli_generate
from jaxdit.generate_checks import PIPEFUSION_OPTIONS_ALONE, check_load_options, takes_guidance_scale
from jaxdit.mesh import DeviceMesh, ParallelConfig
from jaxdit.pipelines.denoiser import SCHEDULE_ROWS, GenerationCancelled, schedule_rows
from jaxdit.pipelines.output import save_video, to_uint8
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.serve.images import decode, encode_png
from jaxdit.serve.schema import IMAGE, VIDEO, Generation, ModelCard, RequestError

__all__ = ["Engine", "EngineLimits", "GenerationCancelled", "Output", "image_counts"]

StepCallback = Callable[[int, int], bool]
#: The flags in `jaxdit generate`'s messages -> the request fields they are.
_FIELDS = {
    "prompt": "prompt",
    "negative_prompt": "negative_prompt",
    "num_inference_steps": "steps",
    "guidance_scale": "guidance",
    "true_cfg_scale": "true_cfg_scale",
    "num_frames": "num_frames",
    "height": "size",
    "width": "size",
    # PipeFusion's (the server's flags): a request's steps or size is what they do not fit.
    "warmup_steps": "steps",
    "num_pipeline_patch": "size",
    "cache_threshold": "cache_threshold",
    "cache": "cache",
    "image": "image",
}
#: The caches whose threshold is traced into the compiled step (the others plan their steps on the host).
_THRESHOLD_IN_PROGRAM = ("fbcache", "dbcache", "teacache")


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """Server-wide bounds on a request (the CLI's ``--max_*`` flags)."""

    max_steps: int = 100
    max_batch: int = 4
    max_prompt_chars: int = 2000
    max_pixels: int = 2048 * 2048
    max_frames: int = 129
    #: Input pictures per request (models that take them; fewer where the model takes fewer).
    max_images: int = 3
    max_image_pixels: int = 4096 * 4096
    #: The largest request body; None: 1 MiB, or 32 MiB for a model that takes pictures (base64 files).
    max_body_bytes: int | None = None


#: The body limits when none is given (a prompt of a few thousand characters is a few KiB).
BODY_BYTES, BODY_BYTES_WITH_IMAGES = 1 << 20, 32 << 20


@dataclasses.dataclass(frozen=True)
class Output:
    """A finished generation: ``media_type`` (image/png or video/mp4) and one encoded file per item."""

    media_type: str
    files: list[bytes]


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def _mp4(frames: np.ndarray, fps: int) -> bytes:
    with tempfile.TemporaryDirectory(prefix="jaxdit-serve-") as folder:
        return save_video(Path(folder) / "video.mp4", list(frames), fps=fps).read_bytes()


def image_counts(family: Any, folder: Any, max_images: int) -> tuple[int, int]:
    """(least, most) pictures a request sends: the family's (``ModelFamily.image_count``), capped by the
    server's ``max_images``; none for the bundled model and for videos other than the image-to-video
    ones the family serves (``ModelFamily.serves_image_to_video``: the first frame)."""
    if folder is None or (family.makes_video and not family.serves_image_to_video):
        return (0, 0)
    least, most = family.image_count(folder)
    return (least, max_images if most is None else min(most, max_images))


@functools.lru_cache(maxsize=8)
def _read(images: tuple[str, ...]) -> tuple[np.ndarray, ...]:
    """A request's checked base64 pictures -> RGB pixels (the HTTP handler decoded them once already;
    the check and the call of one request share this)."""
    pictures = tuple(decode(text, "image", math.inf)[1] for text in images)
    for p in pictures:
        p.setflags(write=False)  # shared by the calls of one request
    return pictures


def _pictures(images: tuple[str, ...]) -> Any:
    """As `jaxdit generate --image` gives them: None, one picture, or a tuple of several."""
    if not images:
        return None
    pictures = _read(images)
    return pictures[0] if len(pictures) == 1 else pictures


def _field_of(message: str) -> str | None:
    """The request field a `jaxdit generate` message is about (it names flags or call arguments)."""
    for name in re.findall(r"[a-z_]+", message):
        if name in _FIELDS:
            return _FIELDS[name]
    return None


class Engine:
    """One pipeline on one mesh, with the card of what it serves. Build it with :meth:`load`."""

    def __init__(
        self, pipe: Any, template: cli_generate.GenerateRequest, card: ModelCard, mesh: DeviceMesh
    ) -> None:
        import jax

        self.pipe, self.template, self.card = pipe, template, card
        self.family = template.family
        self.parallel = mesh.parallel
        self.num_processes = jax.process_count()
        #: Shape keys whose programs exist (compiled at warm-up, or by an earlier request).
        self.compiled: frozenset[tuple] = frozenset()

    # ------------------------------------------------------------------ building
    @classmethod
    def load(
        cls,
        weights: str | None,
        mesh: Any,
        *,
        dtype: str | None = None,
        limits: EngineLimits = EngineLimits(),
        name: str | None = None,
        compiler_options: dict[str, Any] | None = None,
        warmup_steps: int | None = None,
        num_pipeline_patch: int | None = None,
        quantize: str | None = None,
        fp8_mode: str | None = None,
        fp8_skip_steps: int = 0,
        fp8_keep: str | None = None,
        offload_encoders: bool = False,
        caches: tuple[str, ...] = (),
    ) -> Engine:
        """The pipeline for ``weights`` (None: the bundled model; else a pipeline folder) on ``mesh``;
        jax must be started (devices, processes). ``compiler_options``: XLA's, for the compiled steps.
        ``warmup_steps`` and ``num_pipeline_patch``: PipeFusion's (a mesh with pipefusion > 1), as
        `jaxdit generate`'s flags, for every request. ``quantize``, ``fp8_mode``, ``fp8_skip_steps``,
        ``fp8_keep``, ``offload_encoders``: how the weights are held, as `jaxdit generate`'s flags."""
        import jax.numpy as jnp

        from jaxdit.models.fp8 import choose_mode
        from jaxdit.models.quantize import FP8

        mesh = DeviceMesh.of(mesh)  # read once; the pipeline and the engine are given this object
        template = cls.template_for(
            weights,
            mesh,
            dtype,
            warmup_steps=warmup_steps,
            num_pipeline_patch=num_pipeline_patch,
            quantize=quantize,
            fp8_mode=fp8_mode,
            fp8_skip_steps=fp8_skip_steps,
            fp8_keep=fp8_keep,
            offload_encoders=offload_encoders,
        )
        family, folder = template.family, template.folder
        dtype = jnp.dtype(dtype) if dtype else None
        options = {}
        if quantize == "fp8":
            mode = choose_mode(fp8_mode, mesh.mesh.devices.flat)
            options["fp8"] = FP8(mode, template.fp8_keep_layers, fp8_skip_steps)
        if template.source == "bundled":
            pipe = family.bundled_pipeline(mesh, compiler_options=compiler_options, dtype=dtype, **options)
        else:
            if offload_encoders:
                options["offload_encoders"] = True
            pipe = family.pipeline_class.from_pretrained(
                folder.root, mesh, dtype, compiler_options=compiler_options, **options
            )
        defaults = dataclasses.replace(template, prompt=family.example_prompt).call()
        takes = "true_cfg_scale" in inspect.signature(family.pipeline_class.__call__).parameters
        default_size = (defaults.width, defaults.height)
        images = image_counts(family, folder, limits.max_images)
        body = limits.max_body_bytes or (BODY_BYTES_WITH_IMAGES if images[1] else BODY_BYTES)
        card = ModelCard(
            name=name or (family.name if folder is None else folder.root.name),
            kind=VIDEO if family.makes_video else IMAGE,
            default_size=default_size,
            size_multiple=family.size_multiple(folder),
            fixed_sizes=(default_size,) if family.serves_default_size_only else None,
            default_steps=defaults.num_inference_steps,
            default_guidance=defaults.guidance_scale,
            default_true_cfg=defaults.true_cfg_scale if takes else None,
            default_negative=defaults.negative_prompt,
            default_frames=defaults.num_frames if family.makes_video else None,
            frame_multiple=getattr(pipe, "vae_scale_factor_temporal", 4),
            fps=family.fps,
            prompt_pattern=family.prompt_pattern,
            example_prompt=family.example_prompt,
            takes_guidance=takes_guidance_scale(template),
            max_steps=limits.max_steps,
            max_batch=limits.max_batch,
            max_prompt_chars=limits.max_prompt_chars,
            max_pixels=limits.max_pixels,
            max_frames=limits.max_frames,
            caches=tuple(caches),
            images=images,
            max_image_pixels=limits.max_image_pixels,
            max_body_bytes=body,
            picture_problem=functools.partial(family.picture_problem, folder) if images[1] else None,
            picture_size=functools.partial(family.picture_output_size, folder) if images[1] else None,
        )
        return cls(pipe, template, card, mesh)

    @staticmethod
    def template_for(
        weights: str | None,
        mesh_or_config: Any,
        dtype: str | None = None,
        *,
        warmup_steps: int | None = None,
        num_pipeline_patch: int | None = None,
        quantize: str | None = None,
        fp8_mode: str | None = None,
        fp8_skip_steps: int = 0,
        fp8_keep: str | None = None,
        offload_encoders: bool = False,
    ):
        """The `jaxdit generate` request every served request starts from; checks what cannot be served
        (before jax starts when given a ParallelConfig)."""
        if isinstance(mesh_or_config, ParallelConfig):
            parallel = mesh_or_config
        else:
            parallel = DeviceMesh.of(mesh_or_config).parallel
        if parallel.pipefusion == 1 and (warmup_steps is not None or num_pipeline_patch is not None):
            raise ValueError(PIPEFUSION_OPTIONS_ALONE)
        template = cli_generate.GenerateRequest(
            weights=weights,
            dtype=dtype,
            data_parallel_degree=parallel.data,
            use_cfg_parallel=parallel.cfg == 2,
            ulysses_degree=parallel.ulysses,
            ring_degree=parallel.ring,
            tensor_parallel_degree=parallel.tensor,
            pipefusion_parallel_degree=parallel.pipefusion,
            warmup_steps=warmup_steps,
            num_pipeline_patch=num_pipeline_patch,
            quantize=quantize,
            fp8_mode=fp8_mode,
            fp8_skip_steps=fp8_skip_steps,
            fp8_keep=fp8_keep,
            offload_encoders=offload_encoders,
        )
        check_load_options(template, parallel)
        if weights is not None:
            if template.folder is None:
                raise ValueError(
                    f"--weights {weights}: jaxdit serve needs a whole pipeline folder (model_index.json, text "
                    "encoders, VAE) to go from a prompt to pixels; omit --weights to serve the bundled model"
                )
            family = template.family
            if template.folder.takes_image and family.makes_video and not family.serves_image_to_video:
                raise ValueError(
                    f"{weights} is image-to-video, which jaxdit serve does not run for {family.display}; "
                    "it serves its text-to-video and image models"
                )
        return template

    # ------------------------------------------------------------------ requests
    def _flags(self, g: Generation) -> cli_generate.GenerateRequest:
        """``g`` as `jaxdit generate`'s flags."""
        return dataclasses.replace(
            self.template,
            prompt=g.prompt,
            negative_prompt=g.negative_prompt,
            height=g.height,
            width=g.width,
            num_inference_steps=g.steps,
            guidance_scale=g.guidance,
            true_cfg_scale=g.true_cfg_scale,
            num_frames=g.num_frames,
            seed=g.seed,
            feature_cache=g.cache,
            cache_threshold=g.cache_threshold,
            image=_pictures(g.images),
        )

    def call(self, g: Generation, on_step: StepCallback | None = None) -> GenerationRequest:
        """The pipeline call `jaxdit generate` makes for ``g`` (n images per prompt, pixels out)."""
        flags = self._flags(g)
        call = flags.call()
        if flags.image is not None:
            call = call.replace(image=cli_generate.call_images(flags.image))
        return call.replace(num_images_per_prompt=g.n, output_type="np", progress=False, callback=on_step)

    def uses_cfg(self, g: Generation) -> bool:
        """Whether ``g`` runs classifier-free guidance (as `jaxdit generate` decides it)."""
        return self.family.uses_cfg(self.call(g), self.template.folder)

    @property
    def exact_steps(self) -> bool:
        """Whether a program serves one step count only (PipeFusion), not a bucket of them."""
        return self.parallel.pipefusion > 1

    def shape_key(self, g: Generation) -> tuple:
        """What the compiled programs of ``g`` depend on (see the module docstring)."""
        steps = g.steps if self.exact_steps else schedule_rows(g.steps)
        key = (g.width, g.height, g.n, g.num_frames, self.uses_cfg(g), steps, self.cache_key(g))
        return key + (g.image_sizes,)  # the input pictures' sizes: their reference tokens

    def cache_key(self, g: Generation) -> tuple:
        """The part of a program the request's cache decides: () without one, else its name and its
        threshold (the family's default filled in) where the threshold is traced into the step, 0.0 where
        it is not (or is the model's published one); keys stay sortable."""
        if g.cache is None:
            return ()
        threshold = getattr(self._flags(g).cache(), "threshold", None)
        return (g.cache, float(threshold or 0.0) if g.cache in _THRESHOLD_IN_PROGRAM else 0.0)

    @property
    def shape_fields(self) -> tuple[str, ...]:
        """The request field behind each position of a shape key (to name the one a refusal is about)."""
        cfg = _FIELDS[self.family.cfg_scale_argument]
        return ("size", "size", "n", "num_frames", cfg, "steps", "cache", "image")

    def describe(self, key: tuple) -> str:
        width, height, n, frames, cfg, rows, cache, pictures = key
        parts = [f"{width}x{height}", f"n={n}"] + ([f"{frames} frames"] if frames is not None else [])
        if pictures:
            parts.append("from " + " + ".join(f"{w}x{h}" for w, h in pictures))
        steps = f"{rows} steps" if self.exact_steps else f"{max(1, rows - SCHEDULE_ROWS)}-{rows - 1} steps"
        if cache:
            name, threshold = cache
            steps += f" {name}" + (f" threshold {threshold:g}" if threshold else "")
        return " ".join([*parts, steps, "with CFG" if cfg else "without CFG"])

    def check(self, g: Generation) -> None:
        """What the mesh and the model refuse, as a :class:`RequestError` naming the field (no devices)."""
        if self.parallel.cfg == 2 and not self.uses_cfg(g):
            scale = self.family.cfg_scale_argument
            raise RequestError(
                f"this server splits the two guidance branches over its devices (cfg=2), so every request "
                f"needs classifier-free guidance: {self.family.cfg_needs}",
                _FIELDS[scale],
            )
        if g.n % self.parallel.data:
            raise RequestError(
                f"n={g.n}: this server splits a batch over data={self.parallel.data} devices; n must be a "
                f"multiple of {self.parallel.data}",
                "n",
            )
        try:
            cli_generate.check_request(self._flags(g), output=False)  # no file is written
        except ValueError as e:
            raise RequestError(str(e), _field_of(str(e))) from None

    def request_for(
        self,
        width: int,
        height: int,
        n: int = 1,
        num_frames: int | None = None,
        steps: int | None = None,
        cache: str | None = None,
        pictures: tuple[tuple[int, int], ...] | None = None,
    ) -> Generation:
        """The default request of a shape (for warm-up), with mid-grey input pictures of the sizes
        ``pictures`` (width, height) gives (None: as many as the model needs, of the output's size)."""
        c = self.card
        if pictures is None:
            pictures = ((width, height),) * c.images[0]
        grey = lambda w, h: encode_png(np.full((h, w, 3), 128, np.uint8))  # noqa: E731
        return Generation(
            images=tuple(grey(w, h) for w, h in pictures),
            image_sizes=tuple(pictures),
            kind=c.kind,
            prompt=c.example_prompt,
            width=width,
            height=height,
            n=n,
            steps=steps or c.default_steps,
            guidance=c.default_guidance,
            true_cfg_scale=c.default_true_cfg,
            seed=0,
            negative_prompt=c.default_negative,
            num_frames=num_frames if c.kind == VIDEO else None,
            cache=cache,
        )

    # ------------------------------------------------------------------ running
    def warm_up(self, requests: list[Generation]) -> None:
        """Run each request once, compiling its programs (text encoders, step, VAE, gathers)."""
        for g in requests:
            self.check(g)
            self.generate(g)

    def generate(self, g: Generation, on_step: StepCallback | None = None, encode: bool = True) -> Output:
        """One generation; ``on_step(done, total)`` after each step (False stops it: the pipeline raises
        ``GenerationCancelled``). ``encode=False`` skips writing PNG / MP4 (processes other than 0)."""
        result = self.pipe.generate(self.call(g, on_step))
        # Rebound, not mutated: the HTTP thread reads the set while this (the device worker) runs.
        self.compiled = self.compiled | {self.shape_key(g)}
        if not encode:
            return Output("", [])
        pixels = to_uint8(result.images)
        if self.card.kind == VIDEO:
            return Output("video/mp4", [_mp4(video, self.card.fps) for video in pixels])
        return Output("image/png", [_png(image) for image in pixels])
