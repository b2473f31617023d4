"""One generation request, as a frozen value: what a pipeline call asks for, checked once.

The pipelines' ``__call__`` take diffusers' keyword arguments (that is what users know); they are turned
into a :class:`GenerationRequest` at once, and everything below the call (conditioning, the plain or
PipeFusion denoiser, decoding) reads this one object instead of repeating an 18-argument signature.
Fields a family does not use stay None (a FLUX request has no ``num_frames``; Wan has no
``true_cfg_scale``); fields left None take the pipeline's defaults (its ``__call__``'s). A call argument
of one family alone is no field: it travels in ``family_arguments`` (``jaxdit.pipelines.call_options``),
so that a family adds one without editing this file.

Family-independent checks live here (:meth:`GenerationRequest.check`); what depends on the model
(sizes its VAE and patches divide, the text width of embeddings) is checked by the family's pipeline.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxdit.cache import CacheConfig
from jaxdit.cache.magcache import MagCacheCalibration
from jaxdit.cache.policies import TeaCacheCalibration

__all__ = ["OUTPUT_TYPES", "GenerationRequest", "prompt_list"]

#: ``output_type`` values every pipeline accepts (diffusers' names).
OUTPUT_TYPES = ("np", "pil", "latent")


def _is_number(value: Any, kind: type) -> bool:
    """A number of ``kind`` (numbers.Real / numbers.Integral; numpy's too), not a bool or a string."""
    return isinstance(value, kind) and not isinstance(value, bool | np.bool_)


def prompt_list(prompt: str | list[str] | tuple[str, ...] | None) -> list[str] | None:
    """A prompt or a list of prompts -> a list (None stays None)."""
    if prompt is None:
        return None
    if isinstance(prompt, str):
        return [prompt]
    prompts = list(prompt)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompt must be a string or a non-empty list of strings, got {prompt!r}")
    return prompts


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A pipeline call's arguments (diffusers' names). Arrays are kept as given (numpy or None)."""

    prompt: Any = None
    negative_prompt: Any = None
    prompt_embeds: Any = None
    pooled_prompt_embeds: Any = None  # FLUX (CLIP pooled)
    negative_prompt_embeds: Any = None
    negative_pooled_prompt_embeds: Any = None  # FLUX
    image: Any = None  # image-to-video: the first frame
    image_embeds: Any = None  # Wan I2V: CLIP features
    condition: Any = None  # Wan I2V: mask + first-frame latent
    # None: the pipeline's own default (its ``__call__``'s), filled in by ``DiffusionPipeline.generate``.
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None  # video families
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None  # Wan 2.2 A14B: the low-noise expert's (default: guidance_scale)
    true_cfg_scale: float | None = (
        None  # FLUX's classifier-free guidance (guidance_scale is its embedded one)
    )
    flow_shift: float | None = None  # Wan: UniPC sigma shift (default: the scheduler's or by resolution)
    seed: int = 0
    latents: Any = None  # initial noise instead of the seed's, shaped like the family's latents
    max_sequence_length: int | None = None
    num_images_per_prompt: int = 1
    output_type: str = "np"
    progress: bool = True
    #: Called on the host after each denoising step as ``callback(step, total)``; returning False stops
    #: the loop there (the result is then not produced: :class:`GenerationCancelled` is raised).
    callback: Any = None
    #: PipeFusion (meshes with pipefusion > 1; xDiT's flags): synchronous first steps (default 1), patches
    #: (default: the family's full pipeline), and a family's own option (Wan: patch_by "rows"/"frames").
    warmup_steps: int | None = None
    num_pipeline_patch: int | None = None
    patch_by: str | None = None
    #: A feature cache (``jaxdit.cache.FirstBlockCache`` or ``TeaCache``), or None.
    cache: Any = None
    #: The family's own call arguments by name: its pipeline's ``call_options``
    #: (``jaxdit.pipelines.call_options``), e.g. FLUX.1 Kontext's ``max_area``. None: the call's default.
    family_arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, **arguments: Any) -> GenerationRequest:
        """A request from a pipeline call's keyword arguments: the shared fields as fields, the rest (the
        family's own arguments, which its ``__call__`` signature has already named) in
        ``family_arguments``."""
        shared = {f.name for f in dataclasses.fields(cls)}
        own = {k: v for k, v in arguments.items() if k not in shared}
        return cls(**{k: v for k, v in arguments.items() if k in shared}).with_family_arguments(**own)

    def with_arguments(self, **arguments: Any) -> GenerationRequest:
        """This request with call arguments changed: shared fields replaced, the rest among
        ``family_arguments`` (e.g. the arrays of an embeddings file, which a family may name)."""
        shared = {f.name for f in dataclasses.fields(self)}
        own = {k: v for k, v in arguments.items() if k not in shared}
        return self.replace(**{k: v for k, v in arguments.items() if k in shared}).with_family_arguments(
            **own
        )

    def with_family_arguments(self, **arguments: Any) -> GenerationRequest:
        return self.replace(family_arguments={**self.family_arguments, **arguments}) if arguments else self

    def check(self) -> None:
        """Family-independent checks; raise ``ValueError`` naming the argument."""
        if self.output_type not in OUTPUT_TYPES:
            raise ValueError(
                f"output_type must be one of {', '.join(OUTPUT_TYPES)}, got {self.output_type!r}"
            )
        for name in ("guidance_scale", "guidance_scale_2", "true_cfg_scale", "flow_shift"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value, numbers.Real) or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("height", "width", "num_frames", "num_inference_steps", "num_images_per_prompt", "seed"):
            value = getattr(self, name)
            if (value is not None or name == "seed") and not _is_number(value, numbers.Integral):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.seed < 0:
            raise ValueError(
                f"seed must be >= 0 (numpy's generator draws the noise from it), got {self.seed}"
            )
        if self.callback is not None and not callable(self.callback):
            raise ValueError(f"callback must be callable as callback(step, total), got {self.callback!r}")
        if self.latents is not None and not np.isfinite(np.asarray(self.latents, np.float32)).all():
            raise ValueError("latents hold NaN or inf")
        if self.prompt is not None and self.prompt_embeds is not None:
            raise ValueError("pass either a prompt or prompt embeddings, not both")
        if self.height is None or self.width is None or self.num_inference_steps is None:
            raise ValueError(
                "height, width and num_inference_steps must be set (the pipeline fills defaults)"
            )
        if self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {self.num_inference_steps}")
        if self.num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be >= 1, got {self.num_images_per_prompt}")
        if self.height < 1 or self.width < 1:
            raise ValueError(f"height and width must be positive, got {self.height}x{self.width}")
        if self.cache is not None and not isinstance(
            self.cache, CacheConfig | MagCacheCalibration | TeaCacheCalibration
        ):
            raise ValueError(
                "cache must be a jaxdit.cache FirstBlockCache, TeaCache, MagCache, TaylorSeer or DBCache, "
                f"got {self.cache!r}"
            )

    def replace(self, **changes: Any) -> GenerationRequest:
        return dataclasses.replace(self, **changes)
