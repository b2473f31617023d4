"""What PipeFusion's runner asks of a model family (arXiv 2405.14430), as two protocols.

A family's adapter (``pipefusion/flux.py``, ``pipefusion/wan.py``) says how one generation's tokens split
into patches and how a patch is embedded and conditioned, by calling the model's own staged pieces
(``jaxdit.models.staged``); the blocks themselves run through the model's ``enter`` / ``run_block`` /
``output`` in the runner's programs, the same for every family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
from flax import nnx

from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines.pipefusion.geometry import PatchGeometry

__all__ = ["PatchFamily", "PatchPieces"]


class PatchPieces(Protocol):
    """A family's staged pieces on one generation's patches (local view, inside the program).

    ``patch`` is a traced patch index, or None for every patch at once (the warm-up's full sequence).
    """

    def step_cond(self, time: jax.Array) -> Any:
        """The per-step conditioning from the sampler's model time (FLUX: vec; Wan: temb, projection)."""

    def embed(self, x: jax.Array, patch: jax.Array | None) -> Any:
        """A patch's latent tokens [b, n, K] (requests; CFG not doubled) -> the streams entering stack 0."""

    def cond(self, step_cond: Any, patch: jax.Array | None) -> Any:
        """The model's ``Cond`` for ``patch`` at the step of ``step_cond``."""

    def prediction(self, pred: jax.Array) -> jax.Array:
        """The model's ``output`` -> the latent tokens' feature order."""

    #: Optional (None where every prompt is padded alike): per token group, a [b, M, S, g] bool array of
    #: each local model-batch row's real tokens in each piece (Qwen-Image's prompt lengths), or None for a
    #: group whose real tokens are the geometry's. The programs then mask keys per row.
    sample_valid: tuple[jax.Array | None, ...] | None


class PatchFamily(Protocol):
    """A model family's adapter (``pipefusion/flux.py``, ``pipefusion/wan.py``): how one generation's
    tokens split into patches, and how a patch is embedded and conditioned by the model's own pieces."""

    #: The residual streams' width.
    width: int
    #: Features of one latent token (K).
    latent_features: int
    #: Program context entry -> logical axes of its array (see ``sharding_rules``).
    context_axes: Mapping[str, tuple[str | None, ...]]

    def default_patches(self, grid: tuple[int, ...], parallel: ParallelConfig, **options) -> int:
        """The patch count when a call gives none."""

    def validate_patches(
        self, grid: tuple[int, ...], patches: int, parallel: ParallelConfig, **options
    ) -> None:
        """Raise ValueError (naming the numbers) for patches the token grid or the sequence degree
        cannot split."""

    def geometry(
        self, grid: tuple[int, ...], patches: int, parallel: ParallelConfig, requests: int, context, **options
    ) -> PatchGeometry:
        """The geometry of a generation with this forward context (diffusers' names, CFG interleaved)."""

    def program_context(self, context: Mapping, g: PatchGeometry, dtype: Any) -> dict[str, tuple | None]:
        """The forward context in the programs' patch layout: entry -> (host array, dtype to place it
        in), or None when absent."""

    def abstract_context(self, g: PatchGeometry, dtype: Any) -> dict[str, tuple | None]:
        """The same entries' (shape, dtype), or None when absent."""

    def pieces(
        self, model: nnx.Module, context: dict, g: PatchGeometry, *, full: bool, batch: Callable
    ) -> PatchPieces:
        """The staged pieces on a call's placed context (inside the program); ``batch`` doubles a
        per-request array into the model batch when both CFG branches share a device."""
