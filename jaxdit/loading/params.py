"""Checkpoint -> parameters placed on a mesh, for any model family: :func:`load_params`.

A family's checkpoints are read through its :class:`~converters.checkpoints.CheckpointFormat` (detect,
open, the config's JSON form, the abstract model), declared next to its key tables; this module knows
no family. The parameters go straight into the mesh's shardings: each device reads only its own slice of
the memory-mapped safetensors, or of the orbax checkpoint written by :func:`convert_checkpoint`.

``jaxdit.families`` finds the family of a path (its registry) and builds the user-facing callables
(``jaxdit.load_transformer``) on top of this.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from converters import orbax_io
from converters.checkpoints import CheckpointFormat, Source
from converters.checks import check_compute_dtype
from converters.errors import CheckpointError
from converters.keymap import place_params
from jaxdit.lora import fuse_loras, read_loras
from jaxdit.mesh import DeviceMesh, MeshLike, single_device_mesh
from jaxdit.models.partitioning import named_shardings
from jaxdit.models.quantize import FP8, as_fp8, quantize_model
from sharding_rules import rules_for

__all__ = [
    "checkpoint_config",
    "convert_checkpoint",
    "flat_path",
    "load_params",
    "resolve_keys",
]

PathLike = str | os.PathLike[str]


def flat_path(p: tuple) -> str:
    """An nnx state path as the dotted name key tables use (``double_blocks.img_attn.q.kernel``)."""
    return ".".join(map(str, p))


def _fill(abstract_state: nnx.State, arrays: Mapping[str, Any]) -> nnx.State:
    flat = nnx.to_flat_state(abstract_state)
    return nnx.from_flat_state([(p, v.replace(arrays[flat_path(p)])) for p, v in flat])


def resolve_keys(checkpoints: CheckpointFormat, source: Source, dtype: Any = jnp.float32) -> None:
    """Check the checkpoint's key table against the model's parameters from headers alone (strict: a
    missing, extra or misshaped tensor is a ``CheckpointError`` naming it); reads no tensor."""
    abstract = nnx.state(checkpoints.abstract_model(source.config, dtype))
    source.resolve({flat_path(p): tuple(v.shape) for p, v in nnx.to_flat_state(abstract)})


def _orbax_config(path: Path, checkpoints: CheckpointFormat) -> tuple[dict[str, Any], Any]:
    """A ``jaxdit convert`` folder's metadata and config, its family checked."""
    meta = orbax_io.read_metadata(path)
    if meta["family"] != checkpoints.name:
        raise CheckpointError(f"{path}: a {meta['family']!r} checkpoint, not {checkpoints.name!r}")
    return meta, checkpoints.config_from_json(meta["config"])


def checkpoint_config(path: PathLike, checkpoints: CheckpointFormat) -> Any:
    """The config of a checkpoint in any layout the family reads (``jaxdit convert`` folders included),
    from its config file or headers only."""
    path = Path(path)
    if orbax_io.is_orbax_checkpoint(path):
        return _orbax_config(path, checkpoints)[1]
    return checkpoints.open(path, None).config


def load_params(
    path: PathLike,
    mesh: MeshLike,
    dtype: Any = None,
    *,
    checkpoints: CheckpointFormat,
    config: Any = None,
    rules: Mapping[str, object] | None = None,
    check: Callable[[Any], None] | None = None,
    fp8: str | FP8 | None = None,
) -> nnx.Module:
    """Read the checkpoint at ``path`` (of the family whose ``checkpoints`` format is given) into a model whose parameters live on ``mesh``.

    ``dtype`` defaults to the checkpoint's storage dtype; ``rules`` to the mesh's rule table.
    ``check(config)`` runs once the config is known and before any tensor is read (e.g. heads against
    the mesh). ``fp8``: ``"weight"`` or ``"matmul"`` (or a ``jaxdit.models.quantize.FP8``: keep list,
    skipped steps) turns the block stacks' linear layers to FP8 once they are placed; a ``jaxdit convert
    --quantize fp8`` folder is FP8 already and restores as it is (``"weight"`` unless ``fp8`` says
    otherwise), never holding the higher-precision weights.
    """
    fp8 = as_fp8(fp8)
    check_compute_dtype(dtype)
    path = Path(path)
    where = DeviceMesh.of(mesh)
    mesh, degrees = where.mesh, where.parallel
    rules = rules if rules is not None else rules_for(tensor=degrees.tensor, pipefusion=degrees.pipefusion)
    if orbax_io.is_orbax_checkpoint(path):
        meta, recorded = _orbax_config(path, checkpoints)
        cfg = recorded if config is None else config
        if check is not None:
            check(cfg)
        dtype = jnp.dtype(dtype or meta["dtype"])
        model = checkpoints.abstract_model(cfg, dtype)
        if meta.get("fp8"):
            if fp8 is not None and (fp8.skip_steps or fp8.keep is not None):
                raise ValueError(
                    f"{path} holds FP8 weights only (jaxdit convert --quantize fp8): skipped bf16 steps "
                    "and another keep list need the original weights; load the checkpoint it came from"
                )
            quantize_model(model, fp8.mode if fp8 else "weight")
        graphdef, abstract = nnx.split(model)
        shardings = named_shardings(abstract, rules, mesh, degrees)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
        )
        restored = orbax_io.restore(path, nnx.to_pure_dict(target))
        state = abstract
        nnx.replace_by_pure_dict(state, restored)
        return nnx.merge(graphdef, state)

    source = checkpoints.open(path, config)
    if check is not None:
        check(source.config)
    dtype = jnp.dtype(dtype or source.dtype)
    graphdef, abstract = nnx.split(checkpoints.abstract_model(source.config, dtype))
    flat = nnx.to_flat_state(abstract)
    lazies = source.resolve({flat_path(p): tuple(v.shape) for p, v in flat})
    shardings = {
        flat_path(p): s.get_value()
        for p, s in nnx.to_flat_state(named_shardings(abstract, rules, mesh, degrees))
    }
    arrays = place_params(lazies, shardings, dtype)
    model = nnx.merge(graphdef, _fill(abstract, arrays))
    if fp8 is not None:
        quantize_model(model, fp8.mode, fp8.keep, skip_steps=fp8.skip_steps)
        _place_by_rules(model, rules, mesh, degrees)
    return model


def _place_by_rules(model: nnx.Module, rules: Any, mesh: Any, degrees: Any) -> None:
    """Every parameter of ``model`` where the rule table (and fsdp) stores it, in place: the FP8 scales
    are made laid out like their kernel's output axis, but fsdp splits a 1-D scale on its own (the other
    arrays are there already and do not move)."""
    state = nnx.state(model)
    shardings = named_shardings(state, rules, mesh, degrees)
    nnx.update(model, jax.tree.map(jax.device_put, state, shardings))


def convert_checkpoint(
    src: PathLike,
    dst: PathLike,
    dtype: Any = None,
    *,
    checkpoints: CheckpointFormat,
    config: Any = None,
    overwrite: bool = False,
    loras: Any = (),
    fp8: bool = False,
) -> Path:
    """Convert a checkpoint (of the family whose ``checkpoints`` format is given) into a jaxdit (orbax) folder, atomically; loaded on one device.

    ``loras``: (path, scale) pairs fused into the weights before they are written (every file checked
    against the model before the checkpoint's tensors are read). ``fp8``: write the block stacks'
    linear layers as FP8 with their scales (after the LoRAs are fused), half the bytes of bf16."""
    orbax_io.check_destination(dst, overwrite=overwrite)  # before the source is read
    if loras:
        source = checkpoints.open(Path(src), config) if not orbax_io.is_orbax_checkpoint(Path(src)) else None
        if source is not None:
            read_loras(loras, source.config)
    model = load_params(src, single_device_mesh(), dtype, checkpoints=checkpoints, config=config)
    if loras:
        fuse_loras(model, model.config, loras)
    dtype = jax.tree.leaves(nnx.state(model, nnx.Param))[0].dtype
    if fp8:
        quantize_model(model, "weight")
    state = nnx.state(model, nnx.Param)
    meta = {
        "family": checkpoints.name,
        "dtype": jnp.dtype(dtype).name,
        "config": checkpoints.config_to_json(model.config),
        **({"fp8": True} if fp8 else {}),
    }
    return orbax_io.save(dst, nnx.to_pure_dict(state), meta, overwrite=overwrite)
