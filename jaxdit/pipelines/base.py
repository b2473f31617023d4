"""What every pipeline does around its family's specifics: request -> conditioning -> denoise -> decode.

A family's pipeline (``pipelines/flux.py``, ``pipelines/wan.py``) subclasses :class:`DiffusionPipeline`
and implements one method, :meth:`DiffusionPipeline.prepare`: from a :class:`GenerationRequest` to the
denoiser's inputs (latent tokens, the forward's context, the sampler's schedule) and the function that
turns the final tokens back into latents. Everything else is here, once:

- the call template (checks, the denoising loop, decoding, ``output_type`` np / pil / latent);
- the denoiser's interface: the plain loop (:class:`~jaxdit.pipelines.denoiser.Denoiser`) or, when the
  mesh has ``pipefusion > 1``, the PipeFusion runner (``pipelines/pipefusion/denoiser.py``), which each
  family's constructor picks; ``from_checkpoint`` for either;
- prompt encoding with classifier-free guidance branches laid out for the ``cfg`` axis, and
  ``num_images_per_prompt``.

Text encoders and the VAE plug in as callables (``encode(prompts, **options)``, ``decode(latents)``), so
a pipeline runs as well with embeddings only (``output_type="latent"`` without a decoder) as from a
downloaded folder (``jaxdit.families`` builds those).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

import jax
import numpy as np
from jax.sharding import Mesh

from converters.checkpoints import CheckpointFormat
from jaxdit.lora import FusedLoras, LoraArg, fuse_loras, read_loras, unfuse_loras
from jaxdit.mesh import DeviceMesh, MeshLike, ParallelConfig
from jaxdit.models.quantize import retained
from jaxdit.parallel.cfg import interleave_branches
from jaxdit.parallel.kernels import check_kernel_options, with_backend
from jaxdit.pipelines import finite
from jaxdit.pipelines.assemble import load_model, preset_check
from jaxdit.pipelines.call_options import CallOption
from jaxdit.pipelines.denoiser import DenoiseInputs, Denoiser
from jaxdit.pipelines.pipefusion import cache as pipefusion_cache
from jaxdit.pipelines.pipefusion.denoiser import PipeFusionDenoiser
from jaxdit.pipelines.pipefusion.runner import PipeFusionRunner
from jaxdit.pipelines.preflight import check_prompts
from jaxdit.pipelines.request import GenerationRequest, prompt_list

__all__ = [
    "DiffusionPipeline",
    "GenerationOutput",
    "Prepared",
    "fuse_on_top",
    "to_pil",
]

#: Arrays a call may pass instead of what the encoders make: checked finite before any work.
GIVEN_ARRAYS = (
    "prompt_embeds",
    "pooled_prompt_embeds",
    "negative_prompt_embeds",
    "negative_pooled_prompt_embeds",
    "image_embeds",
    "condition",
)


@dataclasses.dataclass
class GenerationOutput:
    #: Decoded pictures: np [B, H, W(, C)] (videos [B, F, H, W, C]) in [-1, 1]; PIL images for
    #: output_type="pil" (a list, or a list of frame lists for videos); None for "latent".
    images: Any
    latents: np.ndarray  # the family's latents, e.g. [B, C, h, w] (FLUX) or [B, C, F', h, w] (Wan)
    seconds: float  # wall time of the denoising loop (compile included on a first call)
    #: What a feature cache did (``jaxdit.cache.CacheReport``: steps run in full, skipped blocks,
    #: memory per device, whether every device decided alike); None without a cache.
    cache: Any = None


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A request turned into the denoiser's inputs, and how to read its final tokens back."""

    inputs: DenoiseInputs
    to_latents: Callable[[np.ndarray], np.ndarray]


def to_pil(images: np.ndarray) -> list:
    """[-1, 1] pictures [B, H, W(, 3)] (or videos [B, F, H, W, 3]) -> PIL images (lists of frames)."""
    from PIL import Image

    pixels = np.round((np.clip(np.asarray(images, np.float32), -1, 1) + 1) * 127.5).astype(np.uint8)
    if pixels.ndim == 5:
        return [[Image.fromarray(frame) for frame in video] for video in pixels]
    return [Image.fromarray(p) for p in pixels]


class DiffusionPipeline:
    """A transformer on a mesh, a sampler, optional encoders and decoder (see the module docstring).

    Subclasses set :meth:`prepare`, ``checkpoints``, ``staged_model`` and, in their constructor, ``denoiser``
    (the plain loop, or the PipeFusion runner on a mesh with ``pipefusion > 1``).
    """

    #: What a cfg=2 mesh needs, in the family's own words (completes the error message).
    cfg_hint: str = "pass negative conditioning with a guidance scale > 1"
    #: The family's transformer checkpoints (``converters.<family>.CHECKPOINTS``) and its PipeFusion
    #: stage layout (a ``StagedModel`` class), set by each family's pipeline.
    checkpoints: ClassVar[CheckpointFormat]
    staged_model: ClassVar[type]
    #: The call arguments of this family alone (keywords of ``__call__`` that are no ``GenerationRequest``
    #: field) with their ``jaxdit generate`` flags; ``__call__`` passes them on with
    #: ``GenerationRequest.of``, and they arrive in ``request.family_arguments``.
    call_options: ClassVar[tuple[CallOption, ...]] = ()
    #: The feature caches its PipeFusion runner is tested with (host-planned ones only:
    #: ``jaxdit.pipelines.pipefusion.cache``); any other is refused with PipeFusion before any work. The
    #: one source: a model family reads its pipeline class's.
    pipefusion_caches: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        parallel: ParallelConfig | Mesh | None = None,
        dtype: Any = None,
        *,
        preset: str | None = None,
        kernel: Mapping[str, Any] | None = None,
        compiler_options: Mapping[str, Any] | None = None,
        attention_backend: str | None = None,
        fp8: str | None = None,
        **options: Any,
    ) -> Self:
        """A transformer checkpoint alone (a diffusers, original or ``jaxdit convert`` folder, a BFL file):
        calls take prompt embeddings and, without a VAE, return latents (``output_type="latent"``).

        ``preset`` (e.g. ``"flux-dev"``): the checkpoint must be that architecture. The preset, the mesh's
        heads, the kernel options and the pipeline's ``options`` are all checked before any weight is read.
        On a mesh with ``pipefusion > 1`` each device reads only its stages' blocks.
        ``fp8``: ``"weight"`` or ``"matmul"``: the transformer blocks' linear layers in FP8
        (``jaxdit.models.fp8``; plain meshes, not PipeFusion).
        """
        kernel = with_backend(kernel, attention_backend)
        check_kernel_options(kernel)
        mesh = DeviceMesh.of(parallel)
        # The pipeline's own keyword arguments, checked now rather than after the weights load.
        inspect.signature(cls.__init__).bind(
            None, None, mesh, kernel=kernel, compiler_options=compiler_options, **options
        )
        check = preset_check(path, cls.checkpoints, preset)
        model = load_model(Path(path), mesh, dtype, cls.checkpoints, check, staged=cls.staged_model, fp8=fp8)
        return cls(model, mesh, kernel=kernel, compiler_options=compiler_options, **options)

    def __init__(self, mesh: MeshLike, *, encode: Any = None, decode: Any = None) -> None:
        #: The mesh and its degrees as one object (what the family's forward and loaders are given);
        #: ``mesh`` is its jax mesh, ``parallel`` its degrees.
        self.device_mesh = DeviceMesh.of(mesh)
        self.mesh = self.device_mesh.mesh
        self.parallel = self.device_mesh.parallel
        self.encode = encode
        self.decode = decode
        #: The LoRAs fused into the transformer's weights now (``load_lora``), or None.
        self.loras: FusedLoras | None = None
        #: FP8 with skipped steps: (the original weights' forward, the steps it runs at each end), set by
        #: :meth:`plain_forward`; None otherwise.
        self.high_precision: tuple[Any, int] | None = None

    # ------------------------------------------------------------------ the denoiser, chosen once here
    def plain_forward(self, sharded: Callable[..., Any], model: Any, kernel: Any = None) -> Any:
        """``sharded(model, mesh, kernel=)`` (the family's sharded forward) on a plain mesh; None under
        PipeFusion, where ``model`` is the stage layout and the runner computes."""
        # The DeviceMesh, not its jax mesh: a mesh alone has no ParallelConfig.fsdp.
        if self.parallel.pipefusion > 1:
            return None
        # FP8 with skipped steps (quantize.FP8.skip_steps): the original weights' forward runs those.
        kept = retained(model)
        if kept is not None:
            self.high_precision = (sharded(kept.original, self.device_mesh, kernel=kernel), kept.skip_steps)
        return sharded(model, self.device_mesh, kernel=kernel)

    def denoiser_for(
        self,
        model: Any,
        sampler: Any,
        *,
        patches: Callable[[Any], Any] | None,
        kernel: Any = None,
        compiler_options: Any = None,
        token_hooks: Any = None,
        dtype: Any = None,
        experts: Any = None,
        guidance: Callable[..., Any] | None = None,
    ) -> Any:
        """The denoising loop for this mesh: the PipeFusion runner over ``model``'s stages (``patches``:
        the family's patch geometry class) where the mesh has ``pipefusion > 1``, else the plain loop over
        ``self.forward`` (:meth:`plain_forward`). Every family's pipeline gets its denoiser here.
        ``guidance``: the family's CFG rule for PipeFusion's patches (the plain loop takes it from
        ``token_hooks``)."""
        if self.parallel.pipefusion > 1:
            if patches is None:
                raise ValueError(
                    f"{type(self).__name__} does not run PipeFusion yet: use ulysses/ring/tensor/cfg"
                )
            runner = PipeFusionRunner(
                patches(model.config),
                model,
                kernel=kernel,
                compiler_options=compiler_options,
                guidance=guidance,
            )
            return PipeFusionDenoiser(runner, sampler, experts=experts)
        # XLA options belong to the outermost jit (the step); jax rejects them on a nested one.
        return Denoiser(
            self.forward,
            sampler,
            token_hooks,
            dtype=model.dtype if dtype is None else dtype,
            compiler_options=compiler_options,
            experts=experts,
            high_precision=self.high_precision,
        )

    @property
    def last_step(self):
        """The last denoising step function and its abstract arguments (the plain loop's)."""
        return getattr(self.denoiser, "last_step", None)

    @property
    def last_programs(self):
        """PipeFusion: the last call's warm-up and pipelined programs with abstract arguments."""
        return getattr(self.denoiser, "last_programs", None)

    @property
    def runner(self):
        """PipeFusion: the runner behind the denoiser (None on a plain mesh)."""
        return getattr(self.denoiser, "runner", None)

    @property
    def _programs(self) -> dict:
        """PipeFusion: (geometry, guided) -> the programs compiled for it."""
        return self.runner.programs

    # ------------------------------------------------------------------ LoRA
    def lora_targets(self) -> tuple[Any, Any, Any]:
        """(the transformer's parameter state as the denoiser reads it, its config, the stack layout
        of PipeFusion's stage slots or None): what ``load_lora`` fuses into."""
        if self.parallel.pipefusion > 1:
            return self.model.state, self.config, self.model.orders
        return self.forward.state, self.config, None

    def load_lora(self, loras: LoraArg | list[LoraArg], scale: float = 1.0) -> FusedLoras:
        """Fuse LoRA file(s) into the transformer's weights where they lie on the mesh, on top of those
        already loaded (diffusers' ``load_lora_weights`` + ``fuse_lora``). ``loras``: a path, or a list of
        paths / ``(path, scale)`` pairs; ``scale`` applies to the ones given without one.

        Every file is read and checked against the model first (layout, family, sizes, finite values):
        a bad file changes nothing. Shapes and shardings stay, so the compiled step is reused.
        """
        self.loras = fuse_on_top(self.lora_targets, self.config, self.loras, loras, scale)
        return self.loras

    def unload_lora(self) -> None:
        """Take every loaded LoRA out of the weights (each weight back within one rounding)."""
        if self.loras is not None:
            state, _, _ = self.lora_targets()
            unfuse_loras(state, self.loras)
            self.loras = None

    # ------------------------------------------------------------------ family hook
    def prepare(self, request: GenerationRequest) -> Prepared:
        raise NotImplementedError

    # ------------------------------------------------------------------ the call
    #: (height, width) of a call that gives neither, where ``__call__`` leaves them None (FLUX, as diffusers:
    #: its default sample size); an object may narrow it (the bundled tiny-digits draws 16x16).
    default_size: tuple[int, int] | None = None

    @classmethod
    def call_defaults(cls) -> dict[str, Any]:
        """The defaults of this pipeline's ``__call__`` (diffusers' for the model), by argument name."""
        parameters = inspect.signature(cls.__call__).parameters
        defaults = {
            n: p.default for n, p in parameters.items() if p.default not in (inspect.Parameter.empty, None)
        }
        if cls.default_size is not None:
            defaults["height"], defaults["width"] = cls.default_size
        return defaults

    def with_defaults(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with every field it left None set to this pipeline's call default."""
        defaults = self.call_defaults()
        if self.default_size is not None:  # this object's, which may differ from its class's
            defaults["height"], defaults["width"] = self.default_size
        unset = {
            f.name: defaults[f.name]
            for f in dataclasses.fields(request)
            if getattr(request, f.name) is None and f.name in defaults
        }
        own = request.family_arguments
        unset_own = {
            o.name: defaults[o.name]
            for o in self.call_options
            if own.get(o.name) is None and o.name in defaults
        }
        request = request.replace(**unset) if unset else request
        return request.with_family_arguments(**unset_own)

    def generate(self, request: GenerationRequest) -> GenerationOutput:
        """Run one request: checks, conditioning, the denoising loop, decoding."""
        request = self.with_defaults(request)
        request.check()
        finite.check_arrays("request", {name: getattr(request, name) for name in GIVEN_ARRAYS}, given=True)
        if request.output_type != "latent" and self.decode is None:
            raise ValueError("this pipeline has no decoder (VAE): use output_type='latent'")
        if request.cache is not None and self.parallel.pipefusion > 1:
            self.check_pipefusion_cache(getattr(request.cache, "name", ""))
        options = self.denoiser_options(request)
        if request.cache is not None:
            options["cache"] = request.cache
        prepared = self.prepare(request)
        result = self.denoiser.run(
            prepared.inputs, progress=request.progress, callback=request.callback, **options
        )
        latents = prepared.to_latents(result.tokens)
        images = None
        if request.output_type != "latent":
            images = self.decode(latents)
            finite.check_arrays("VAE decode", {"decoded pixels": images})
            if request.output_type == "pil":
                images = to_pil(images)
        return GenerationOutput(images=images, latents=latents, seconds=result.seconds, cache=result.cache)

    def check_pipefusion_cache(self, name: str) -> None:
        """Only host-planned caches (MagCache, TaylorSeer) run with PipeFusion (pipefusion/cache.py), and
        only where this pipeline class takes them: the runner's caches AND the class's
        ``pipefusion_caches`` (what ``jaxdit generate`` reads through the family), so a pipeline whose
        PipeFusion cache is untested (its runner shared with another pipeline) is refused here as by the
        CLI; in one line, before any work."""
        takes = frozenset(getattr(self.runner.family, "caches", ())) & type(self).pipefusion_caches
        reason = pipefusion_cache.refusal(name, takes, type(self).__name__)
        if reason is not None:
            raise ValueError(reason)

    def denoiser_options(self, request: GenerationRequest) -> dict[str, Any]:
        """The request's options for this mesh's denoiser: PipeFusion's, which only PipeFusion takes."""
        options = {
            "warmup_steps": request.warmup_steps,
            "num_pipeline_patch": request.num_pipeline_patch,
            "patch_by": request.patch_by,
        }
        given = {k: v for k, v in options.items() if v is not None}
        if self.parallel.pipefusion == 1:
            if given:
                raise ValueError(
                    f"{', '.join(sorted(given))} apply to PipeFusion (a mesh with pipefusion > 1)"
                )
            return {}
        return given

    # ------------------------------------------------------------------ helpers for prepare
    def check_cfg(self, cfg: bool) -> None:
        if self.parallel.cfg == 2 and not cfg:
            raise ValueError(
                "cfg=2 (--use_cfg_parallel) splits the conditional and unconditional branches over two "
                f"devices, but this call runs no classifier-free guidance; {self.cfg_hint}, or put the "
                "devices on ulysses/ring instead"
            )

    def check_batch(self, batch: int, what: str = "images") -> None:
        if batch % self.parallel.data:
            raise ValueError(f"{batch} {what} cannot be split over data={self.parallel.data}")

    def encode_prompts(
        self,
        prompt: str | Sequence[str] | None,
        request: GenerationRequest,
        *,
        batch: int | None = None,
        what: str = "prompt",
    ) -> Any:
        """The text encoder's output for ``prompt`` (a single prompt repeated to ``batch`` rows), each
        prompt repeated ``num_images_per_prompt`` times; None without a prompt."""
        prompts = prompt_list(prompt)
        if prompts is None:
            return None
        if self.encode is None:
            raise ValueError(f"this pipeline has no text encoder: pass {what}_embeds")
        if batch is not None and len(prompts) == 1:
            prompts = prompts * batch
        else:
            prompts = [p for p in prompts for _ in range(request.num_images_per_prompt)]
        options = {}
        if request.max_sequence_length is not None:
            options["max_sequence_length"] = request.max_sequence_length
        check_prompts(prompts, what)
        encoded = self.encode(prompts, **options)
        outputs = jax.tree.leaves(encoded)
        finite.check_arrays("text encoder", {f"{what} embeddings [{k}]": v for k, v in enumerate(outputs)})
        return encoded

    @staticmethod
    def repeat_per_prompt(x: np.ndarray | None, request: GenerationRequest) -> np.ndarray | None:
        """Given embeddings: each row repeated ``num_images_per_prompt`` times (as diffusers)."""
        if x is None or request.num_images_per_prompt == 1:
            return x
        return np.repeat(np.asarray(x), request.num_images_per_prompt, axis=0)

    def branches(self, negative: np.ndarray, positive: np.ndarray) -> np.ndarray:
        """[B, ...] x 2 -> [2B, ...] in the (data shard, branch, request) order the cfg axis splits."""
        return np.asarray(interleave_branches(negative, positive, self.parallel.data))


def fuse_on_top(
    targets: Callable[[], tuple[Any, Any, Any]],
    config: Any,
    fused: FusedLoras | None,
    loras: LoraArg | list[LoraArg],
    scale: float = 1.0,
) -> FusedLoras:
    """Fuse ``loras`` (see :meth:`DiffusionPipeline.load_lora`) into what ``targets()`` returns (a
    pipeline's ``lora_targets``: state, config, stack orders) on top of ``fused`` (None: nothing yet);
    returns the handle of everything now fused there. Every file is read and checked against ``config``
    before ``targets`` is asked for the state (which may move an offloaded expert onto the mesh)."""
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"scale must be a number, got {scale!r}")
    items = loras if isinstance(loras, list) else [loras]
    checked = read_loras([item if isinstance(item, tuple) else (item, scale) for item in items], config)
    state, _, orders = targets()
    added = fuse_loras(state, config, checked, stack_orders=orders)
    return added if fused is None else dataclasses.replace(added, loras=fused.loras + added.loras)
