"""How a video's token grid splits into PipeFusion patches (arXiv 2405.14430): whole latent rows of every
frame (xDiT's split) or whole frames, each patch's video tokens split over ring x ulysses without padding.

Shared by the video families (``pipefusion/wan.py``, ``pipefusion/hunyuan_video15.py``); the grid is the
(F', H', W') token grid after patchify.
"""

from __future__ import annotations

import math

__all__ = ["PATCH_AXES", "default_num_patches", "split_size", "validate_patches"]

#: The grid axis each kind of patch cuts.
PATCH_AXES = {"frames": 0, "rows": 1}


def split_size(grid: tuple[int, int, int], patch_by: str) -> int:
    """The length of the grid axis the patches cut."""
    if patch_by not in PATCH_AXES:
        raise ValueError(f"patch_by must be 'rows' or 'frames', got {patch_by!r}")
    return grid[PATCH_AXES[patch_by]]


def default_num_patches(
    stages: int, grid: tuple[int, int, int], sequence_degree: int = 1, patch_by: str = "rows", passes: int = 1
) -> int:
    """A full pipeline: the fewest patches M >= passes x P (a patch is back at stage 0 after that many
    ticks) that are whole rows (frames) whose tokens the sequence degree divides; where none does, the
    fewest M >= P that are; else P (the checks then say why)."""
    size, tokens = split_size(grid, patch_by), math.prod(grid)
    for low in (passes * stages, stages):
        for m in range(low, size + 1):
            if size % m == 0 and (tokens // m) % sequence_degree == 0:
                return m
    return stages


def validate_patches(
    grid: tuple[int, int, int], patches: int, sequence_degree: int, patch_by: str = "rows"
) -> None:
    """Patches are whole latent rows (or frames) after patchify, and ring x ulysses splits each."""
    size = split_size(grid, patch_by)
    what = "rows" if patch_by == "rows" else "frames"
    f, h, w = grid
    if patches < 1 or size % patches:
        valid = [m for m in range(1, size + 1) if size % m == 0]
        raise ValueError(
            f"num_pipeline_patch={patches} does not divide the {size} latent {what} after patchify "
            f"(token grid {f} frames x {h} rows x {w} columns); patches are whole {what}: use one of "
            f"{', '.join(map(str, valid))}"
        )
    per_patch = math.prod(grid) // patches
    if per_patch % sequence_degree:
        raise ValueError(
            f"each of the {patches} patches has {per_patch} video tokens, which ring x ulysses = "
            f"{sequence_degree} does not divide (PipeFusion does not pad a video's patches); use fewer "
            "patches or another sequence degree"
        )
