"""FLUX.1 with PipeFusion (arXiv 2405.14430): ``FluxPipeline`` on a mesh with ``pipefusion > 1``.

``FluxPipeline`` itself runs PipeFusion when its mesh has pipefusion > 1 (its denoiser is then the
PipeFusion runner, ``jaxdit.pipelines.pipefusion``); this module keeps the constructor from a stage
layout and re-exports FLUX's adapter (``pipefusion/flux.py``: stages, patches of text chunks and image
rows, cost terms) under the names callers use.
"""

from __future__ import annotations

from typing import Any

from jaxdit.pipelines.flux import FluxPipeline
from jaxdit.pipelines.pipefusion.flux import (
    PASSES,
    STACKS,
    Geometry,
    PipeFusionFlux,
    collective_bytes,
    default_num_patches,
    lower,
    make_programs,
    padded_config,
    validate_patches,
)

__all__ = [
    "PASSES",
    "STACKS",
    "Geometry",
    "PipeFusionFlux",
    "PipeFusionFluxPipeline",
    "collective_bytes",
    "default_num_patches",
    "lower",
    "make_programs",
    "padded_config",
    "validate_patches",
]


class PipeFusionFluxPipeline(FluxPipeline):
    """A ``FluxPipeline`` over a model already laid out in stages (its mesh has pipefusion > 1)."""

    def __init__(self, model: PipeFusionFlux, **options: Any) -> None:
        super().__init__(model, model.mesh, **options)
