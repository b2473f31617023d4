"""A downloaded model folder -> a ready pipeline: the pieces every family's ``from_pretrained`` shares.

Placement, and why:

- The transformer is sharded over the mesh as ``parallel`` says (the only part that runs every step).
- The text encoders (and Wan I2V's image encoder) run once per prompt, on one device of the caller's
  choosing (``encoder_device``; default: the first local device). They are separate jitted programs, not
  part of the mesh's step, so they never make the transformer wait, and on a host with a spare card they
  can live there entirely (the chapter's "text encoder on a card of its own").
- The VAE decodes patch-parallel over all of the mesh's devices (rows split, halo rows exchanged), so its
  activation memory per device falls with the device count; 720p video is decodable this way.

Everything that can be wrong with the folder or with the mesh (missing components, heads the degrees do
not split, a transformer checkpoint whose tensors do not match its config) is reported before any weight
is read: :func:`check_transformer` needs only the config and the file headers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from converters import orbax_io
from converters.checkpoints import CheckpointFormat
from jaxdit.loading import checkpoint_config, load_params, resolve_keys
from jaxdit.mesh import DeviceMesh, MeshLike
from jaxdit.models.sharded_forward import validate_forward

__all__ = ["as_dtype", "check_transformer", "load_model", "preset_check"]


def as_dtype(dtype: Any) -> Any:
    """None, a name or a dtype -> None or a numpy dtype (None: the checkpoint's own)."""
    return None if dtype is None else jnp.dtype(dtype)


def check_transformer(
    path: Path,
    mesh: MeshLike,
    checkpoints: CheckpointFormat,
    check: Callable[[Any], None] | None = None,
    config: Any = None,
) -> Any:
    """The transformer's config, checked against the mesh (and ``check``), and its key table checked
    against the checkpoint's tensor names and shapes -- from the config and file headers only, so a broken
    transformer checkpoint is reported before the (large) text encoders are read. (A ``jaxdit convert``
    folder's names and shapes were checked when it was written, and are again when it is restored.)
    ``config``: for a checkpoint whose config cannot be inferred (a BFL file of another RoPE split)."""
    path = Path(path)
    source = None if orbax_io.is_orbax_checkpoint(path) else checkpoints.open(path, config)
    config = checkpoint_config(path, checkpoints) if source is None else source.config
    if check is not None:
        check(config)
    parallel = DeviceMesh.of(mesh).parallel
    if parallel.pipefusion > 1:
        parallel.validate_heads(config.num_heads)
    else:
        validate_forward(parallel, config.num_heads)
    if source is not None:
        resolve_keys(checkpoints, source)  # strict: names the key
    return config


def load_model(
    path: Path,
    mesh: MeshLike,
    dtype: Any,
    checkpoints: CheckpointFormat,
    check: Callable[[Any], None] | None = None,
    staged: Any = None,
    config: Any = None,
    fp8: Any = None,
) -> Any:
    """The transformer's parameters on ``mesh``: on a mesh with ``pipefusion > 1`` the family's PipeFusion
    stage layout (``staged``, a ``StagedModel`` class: each device reads only its own stages' blocks),
    else the plain model (every layer on every device). ``check(config)`` runs before any tensor is read.
    ``fp8``: ``"weight"`` or ``"matmul"`` (``jaxdit.models.fp8``) or a ``jaxdit.models.quantize.FP8``
    (keep list, skipped steps), plain meshes only."""
    where = DeviceMesh.of(mesh)
    parallel = where.parallel
    if fp8 is not None and parallel.pipefusion > 1:
        raise ValueError(
            f"FP8 weights run on meshes without PipeFusion; this one has pipefusion={parallel.pipefusion}"
        )

    def checks(config: Any) -> None:
        if check is not None:
            check(config)
        if parallel.pipefusion > 1:
            staged.check(config, parallel)
        else:
            validate_forward(parallel, config.num_heads)

    if parallel.pipefusion > 1:
        if staged is None:
            raise ValueError(f"pipefusion={parallel.pipefusion}: this family has no PipeFusion stage layout")
        if config is not None:
            raise ValueError("a transformer config override loads on plain meshes only (not pipefusion)")
        return staged._load(path, where, as_dtype(dtype), checks)
    return load_params(
        path, where, as_dtype(dtype), checkpoints=checkpoints, check=checks, config=config, fp8=fp8
    )


def preset_check(
    path: Any, checkpoints: CheckpointFormat, preset: str | None
) -> Callable[[Any], None] | None:
    """A check of a checkpoint's config before any weight is read: with ``preset`` (e.g.
    ``"wan2.1-t2v-14b"``) it must be that architecture; the message names the fields that differ.

    The preset is looked up here, so an unknown name fails before the checkpoint is opened.
    """
    if preset is None:
        return None
    expected = checkpoints.config_class.preset(preset)

    def check(config: Any) -> None:
        if config != expected:
            diff = [
                f"{f.name}={getattr(config, f.name)} (preset: {getattr(expected, f.name)})"
                for f in dataclasses.fields(config)
                if getattr(config, f.name) != getattr(expected, f.name)
            ]
            raise ValueError(f"{path} is not {preset}: {', '.join(diff)}")

    return check
