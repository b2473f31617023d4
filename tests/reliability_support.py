"""Helpers of the reliability suite (tests/test_reliability_*.py): tiny checkpoints with one thing wrong,
spies that prove a check came before the long work, and what a failure may leave behind.

The suite runs against the public behaviour only (``load_transformer``, ``load_params``,
``convert_checkpoint``, ``jaxdit.cli.main``, the converters' readers), so the same cases can be run
against an older checkout to count how each input failed before.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from converters.safetensors_io import open_checkpoint, write_safetensors


class LongWorkStarted(Exception):  # noqa: N818 (a signal raised by spies, not an error condition)
    """Raised by a spy: the code under test went on to read tensors (or the source) before failing."""


def forbid_tensor_reads(monkeypatch) -> None:
    """Any tensor read from a checkpoint (safetensors placement or an orbax restore) raises
    :class:`LongWorkStarted`: the error under test must come from the headers and metadata alone."""
    import converters.keymap
    import converters.orbax_io

    def refuse(*args, **kwargs):
        raise LongWorkStarted("tensors were read")

    monkeypatch.setattr(converters.keymap, "place", refuse)
    monkeypatch.setattr(converters.orbax_io, "restore", refuse)


def forbid_orbax_reads(monkeypatch) -> None:
    """Orbax reading any array of a converted checkpoint raises :class:`LongWorkStarted`."""
    import orbax.checkpoint as ocp

    def refuse(*args, **kwargs):
        raise LongWorkStarted("orbax read the arrays")

    monkeypatch.setattr(ocp.StandardCheckpointer, "restore", refuse)


def forbid_source_reads(monkeypatch) -> None:
    """``convert_checkpoint`` reading its source at all raises :class:`LongWorkStarted`."""
    import jaxdit.loading

    def refuse(*args, **kwargs):
        raise LongWorkStarted("the source was read")

    monkeypatch.setattr(jaxdit.loading, "load_params", refuse)


def tensors_of(folder: Path) -> dict[str, np.ndarray]:
    with open_checkpoint(folder) as ckpt:
        return {k: ckpt.read(k) for k in ckpt}


def variant(folder: Path, dst: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> Path:
    """A copy of a one-file diffusers model folder whose tensors went through ``edit`` (in place)."""
    dst.mkdir(parents=True)
    for name in os.listdir(folder):
        if not name.endswith(".safetensors"):
            shutil.copy(folder / name, dst / name)
    for file in sorted(folder.glob("*.safetensors")):
        with open_checkpoint(file) as ckpt:
            tensors = {k: ckpt.read(k) for k in ckpt}
        edit(tensors)
        write_safetensors(dst / file.name, tensors)
    return dst


def listing(folder: Path) -> list[str]:
    """Every path under ``folder`` (hidden ones too), relative and sorted: what a failure may not add."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def largest_data_file(checkpoint: Path) -> Path:
    """The biggest file of an orbax checkpoint's tensor data (where the weights' bytes are)."""
    files = [p for p in (checkpoint / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def overflowing_copy(pipeline: Path, dst: Path, component: str, key: str) -> Path:
    """A copy of a pipeline folder whose ``component`` tensors named like ``key`` hold one finite value so
    large (the dtype's max / 2) that the first matmul through them overflows: finite weights, inf output."""
    shutil.copytree(pipeline, dst, ignore=lambda d, names: [component] if d == str(pipeline) else [])

    def edit(tensors):
        for name, value in tensors.items():
            if key in name:
                tensors[name] = np.full_like(value, np.finfo(value.dtype).max / 2)

    variant(pipeline / component, dst / component, edit)
    return dst
