"""Wan with PipeFusion (arXiv 2405.14430): ``WanPipeline`` on a mesh with ``pipefusion > 1``.

``WanPipeline`` itself runs PipeFusion when its mesh has pipefusion > 1 (its denoiser is then the
PipeFusion runner, ``jaxdit.pipelines.pipefusion``); this module keeps the constructor from a stage
layout and re-exports Wan's adapter (``pipefusion/wan.py``: stages, patches of latent rows or frames,
per-patch UniPC state, cost terms) under the names callers use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jax.sharding import Mesh

from jaxdit.mesh import DeviceMesh, ParallelConfig
from jaxdit.pipelines.pipefusion.wan import (
    PASSES,
    Geometry,
    PipeFusionWan,
    WanPatches,
    collective_bytes,
    default_num_patches,
    lower,
    make_programs,
    padded_config,
    validate_patches,
)
from jaxdit.pipelines.wan import WanPipeline

__all__ = [
    "PASSES",
    "Geometry",
    "PipeFusionWan",
    "PipeFusionWanPipeline",
    "WanPatches",
    "collective_bytes",
    "default_num_patches",
    "lower",
    "make_programs",
    "padded_config",
    "validate_patches",
]


class PipeFusionWanPipeline(WanPipeline):
    """A ``WanPipeline`` over a model already laid out in stages (its mesh has pipefusion > 1)."""

    def __init__(self, model: PipeFusionWan, **options: Any) -> None:
        super().__init__(model, model.mesh, **options)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        parallel: ParallelConfig | Mesh,
        dtype: Any = None,
        *,
        preset: str | None = None,
        **options: Any,
    ) -> WanPipeline:
        return WanPipeline.from_checkpoint(path, DeviceMesh.of(parallel), dtype, preset=preset, **options)
