"""Load a transformer checkpoint onto a device mesh and call it like diffusers: :func:`load_transformer`.

Any supported checkpoint becomes parameters placed straight into the mesh's shardings (each device reads
only its own slice from the memory-mapped safetensors, or from the orbax checkpoint), then a callable
whose keyword arguments mirror the diffusers model's ``forward``.

Model families plug in through :data:`FAMILIES`: a :class:`Family` says how to recognise its checkpoints,
open them (config + key table), build the abstract model, and wrap a loaded model into the user-facing
callable. FLUX is registered below; another family adds one entry.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from converters import orbax_io
from converters.checks import check_compute_dtype
from converters.errors import CheckpointError
from converters.keymap import place_params
from converters.safetensors_io import LazyTensor, open_checkpoint
from jaxdit.mesh import ParallelConfig, single_device_mesh
from jaxdit.models.partitioning import named_shardings
from jaxdit.models.sharded_forward import validate_forward
from sharding_rules import rules_for

__all__ = [
    "FAMILIES",
    "Family",
    "FluxForward",
    "Source",
    "WanForward",
    "convert_checkpoint",
    "load_params",
    "load_transformer",
]

PathLike = str | os.PathLike[str]


# --------------------------------------------------------------------------------------------------------
# Families
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    """An opened checkpoint: its model config, storage dtype and the lazy target tensors it gives."""

    config: Any
    dtype: np.dtype
    resolve: Callable[[Mapping[str, tuple[int, ...]]], dict[str, LazyTensor]]


@dataclasses.dataclass(frozen=True)
class Family:
    """What :func:`load_transformer` needs to know about one model family.

    ``detect(path)``: is ``path`` a (non-orbax) checkpoint of this family; cheap (config or headers).
    ``open(path, config)``: a :class:`Source`; ``config`` (or None) overrides the inferred config.
    ``config_to_json`` / ``config_from_json``: the config in an orbax checkpoint's ``jaxdit.json``.
    Configs have ``num_heads`` (checked against the mesh before loading).
    ``abstract_model(config, dtype)``: the model with ``ShapeDtypeStruct`` parameters.
    ``wrap(model, mesh, **options)``: the user-facing callable of a loaded model; ``options`` are
    ``kernel`` (attention tile sizes) and ``compiler_options`` (XLA), both may be None.
    """

    name: str
    detect: Callable[[Path], bool]
    open: Callable[[Path, Any], Source]
    config_to_json: Callable[[Any], dict[str, Any]]
    config_from_json: Callable[[Mapping[str, Any]], Any]
    abstract_model: Callable[[Any, Any], nnx.Module]
    wrap: Callable[..., Callable[..., Any]]


#: Registered families, tried in order by :func:`detect_family`.
FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> None:
    FAMILIES[family.name] = family


def detect_family(path: PathLike) -> Family:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    for family in FAMILIES.values():
        if family.detect(path):
            return family
    # Nothing recognised it. A damaged file is the likelier story: let the reader say what is wrong with
    # it (truncated, bad header), naming the file.
    open_checkpoint(path)
    raise CheckpointError(
        f"{path}: not a checkpoint of a known model family ({', '.join(FAMILIES)}); expected a BFL or "
        "diffusers file/folder, or a folder written by `jaxdit convert`"
    )


# --------------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------------


def _path(p: tuple) -> str:
    return ".".join(map(str, p))


def _mesh(parallel: ParallelConfig | Mesh | None) -> Mesh:
    if parallel is None:
        return single_device_mesh()
    if isinstance(parallel, Mesh):
        return parallel
    # The first devices when there are more than the degrees use (e.g. one device of eight).
    devices = jax.devices()
    return parallel.make_mesh(
        devices[: parallel.num_devices] if parallel.num_devices < len(devices) else devices
    )


def _fill(abstract_state: nnx.State, arrays: Mapping[str, Any]) -> nnx.State:
    flat = nnx.to_flat_state(abstract_state)
    return nnx.from_flat_state([(p, v.replace(arrays[_path(p)])) for p, v in flat])


def load_params(
    path: PathLike,
    mesh: Mesh,
    dtype: Any = None,
    *,
    config: Any = None,
    rules: Mapping[str, object] | None = None,
    check: Callable[[Any], None] | None = None,
) -> tuple[Family, nnx.Module]:
    """Read a checkpoint into a model whose parameters live on ``mesh`` (sharded by ``rules``).

    ``dtype`` defaults to the checkpoint's storage dtype. ``check(config)`` runs once the config is known
    and before any tensor is read (e.g. heads against the mesh). Returns the family and the model.
    """
    check_compute_dtype(dtype)
    path = Path(path)
    config_ = ParallelConfig.from_mesh(mesh)
    rules = rules if rules is not None else rules_for(tensor=config_.tensor, pipefusion=config_.pipefusion)
    if orbax_io.is_orbax_checkpoint(path):
        meta = orbax_io.read_metadata(path)
        if meta["family"] not in FAMILIES:
            raise CheckpointError(f"{path}: checkpoint of unknown family {meta['family']!r}")
        family = FAMILIES[meta["family"]]
        cfg = family.config_from_json(meta["config"]) if config is None else config
        if check is not None:
            check(cfg)
        dtype = jnp.dtype(dtype or meta["dtype"])
        graphdef, abstract = nnx.split(family.abstract_model(cfg, dtype))
        shardings = named_shardings(abstract, rules, mesh)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
        )
        restored = orbax_io.restore(path, nnx.to_pure_dict(target))
        state = abstract
        nnx.replace_by_pure_dict(state, restored)
        return family, nnx.merge(graphdef, state)

    family = detect_family(path)
    source = family.open(path, config)
    if check is not None:
        check(source.config)
    dtype = jnp.dtype(dtype or source.dtype)
    graphdef, abstract = nnx.split(family.abstract_model(source.config, dtype))
    flat = nnx.to_flat_state(abstract)
    lazies = source.resolve({_path(p): tuple(v.shape) for p, v in flat})
    shardings = {
        _path(p): s.get_value() for p, s in nnx.to_flat_state(named_shardings(abstract, rules, mesh))
    }
    arrays = place_params(lazies, shardings, dtype)
    return family, nnx.merge(graphdef, _fill(abstract, arrays))


def load_transformer(
    path: PathLike,
    parallel: ParallelConfig | Mesh | None = None,
    dtype: Any = None,
    *,
    config: Any = None,
    kernel: Mapping[str, int] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> Callable[..., jax.Array]:
    """Load a transformer checkpoint onto a mesh; returns a callable mirroring diffusers' ``forward``.

    Args:
      path: a BFL ``.safetensors`` file, a diffusers model or pipeline folder, an original Wan 2.1
        folder or file, or a folder written by ``jaxdit convert`` (orbax).
      parallel: a :class:`ParallelConfig` (its mesh uses the first ``num_devices`` devices) or a mesh;
        None runs on one device.
      dtype: parameter and compute dtype (e.g. ``jnp.bfloat16``); default: the checkpoint's.
      config: overrides the config read or inferred from the checkpoint (needed for BFL files whose RoPE
        split is not FLUX.1's).
      kernel: tile sizes of the local attention kernel (``block_q``, ``block_k``).
      compiler_options: XLA options for the compiled step (see ``ShardedForward``).

    For FLUX the callable is :class:`FluxForward`, for Wan 2.1 :class:`WanForward`.
    """
    mesh = _mesh(parallel)
    # Heads vs ulysses x tensor (and no pipefusion) before a single weight is read.
    check = lambda cfg: validate_forward(ParallelConfig.from_mesh(mesh), cfg.num_heads)
    family, model = load_params(path, mesh, dtype, config=config, check=check)
    return family.wrap(model, mesh, kernel=kernel, compiler_options=compiler_options)


def convert_checkpoint(
    src: PathLike, dst: PathLike, dtype: Any = None, *, config: Any = None, overwrite: bool = False
) -> Path:
    """Convert a checkpoint into a jaxdit (orbax) folder, atomically; loaded on one device."""
    orbax_io.check_destination(dst, overwrite=overwrite)  # before the source is read
    family, model = load_params(src, single_device_mesh(), dtype, config=config)
    state = nnx.state(model, nnx.Param)
    dtype = jax.tree.leaves(state)[0].dtype
    meta = {
        "family": family.name,
        "dtype": jnp.dtype(dtype).name,
        "config": family.config_to_json(model.config),
    }
    return orbax_io.save(dst, nnx.to_pure_dict(state), meta, overwrite=overwrite)


# --------------------------------------------------------------------------------------------------------
# FLUX
# --------------------------------------------------------------------------------------------------------


class FluxForward:
    """A FLUX transformer on a mesh, called like diffusers' ``FluxTransformer2DModel.forward``.

    ``hidden_states`` [B, N, 64] packed latents, ``encoder_hidden_states`` [B, T, 4096] T5 tokens,
    ``pooled_projections`` [B, 768] CLIP pooled, ``timestep`` [B] (or a scalar) sigma in [0, 1],
    ``img_ids`` [N, 3], ``txt_ids`` [T, 3] (3-D ids use the first batch entry, as diffusers does),
    ``guidance`` [B] (or a scalar) for dev, None for schnell. numpy or jax arrays; returns the prediction
    [B, N, 64] as a jax array in the model's dtype. Any N and T: the sequence is padded for the mesh and
    the padding removed.
    """

    def __init__(
        self,
        model: nnx.Module,
        mesh: Mesh,
        *,
        kernel: Mapping[str, int] | None = None,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> None:
        from jaxdit.models import flux

        self.config = model.config
        self.mesh = mesh
        self.dtype = model.dtype
        self.forward = flux.sharded(model, mesh, kernel=kernel, compiler_options=compiler_options)

    @property
    def params(self) -> nnx.State:
        return self.forward.state

    def __call__(
        self,
        hidden_states: Any,
        encoder_hidden_states: Any,
        pooled_projections: Any,
        timestep: Any,
        img_ids: Any,
        txt_ids: Any,
        guidance: Any = None,
    ) -> jax.Array:
        batch = np.shape(hidden_states)[0]
        if self.config.guidance_embed and guidance is None:
            raise ValueError("this FLUX model embeds the guidance scale (dev): pass guidance=")
        if not self.config.guidance_embed and guidance is not None:
            raise ValueError("this FLUX model has no guidance embedding (schnell); pass guidance=None")

        def per_batch(x: Any, name: str) -> Any:
            if x is None:
                return None
            x = _as_float(x, jnp.float32)
            if x.ndim == 0:
                x = x.reshape(1)
            if x.shape[0] == 1 and batch > 1:
                x = (
                    jnp.broadcast_to(x, (batch,))
                    if isinstance(x, jax.Array)
                    else np.broadcast_to(x, (batch,))
                )
            if x.shape != (batch,):
                raise ValueError(f"{name} has shape {x.shape}; expected ({batch},) or a scalar")
            return x

        def ids(x: Any, name: str) -> Any:
            x = _as_float(x, jnp.float32)
            if x.ndim == 3:  # deprecated batched ids: diffusers takes the first
                x = x[0]
            if x.ndim != 2 or x.shape[1] != 3:
                raise ValueError(f"{name} has shape {x.shape}; expected (tokens, 3)")
            return x

        return self.forward(
            hidden_states=_as_float(hidden_states, self.dtype),
            encoder_hidden_states=_as_float(encoder_hidden_states, self.dtype),
            pooled_projections=_as_float(pooled_projections, self.dtype),
            timestep=per_batch(timestep, "timestep"),
            img_ids=ids(img_ids, "img_ids"),
            txt_ids=ids(txt_ids, "txt_ids"),
            guidance=per_batch(guidance, "guidance"),
        )


def _as_float(x: Any, dtype: Any) -> Any:
    """jax arrays stay on device; anything else becomes a numpy array (padded on the host)."""
    if isinstance(x, jax.Array):
        return x.astype(dtype)
    return np.asarray(x).astype(jnp.dtype(dtype))


def _flux_family() -> Family:
    from converters import flux as flux_converters
    from jaxdit.models import flux

    def open_flux(path: Path, config: Any) -> Source:
        ckpt = flux_converters.detect(path, config)
        return Source(ckpt.config, ckpt.dtype, ckpt.resolve)

    return Family(
        name="flux",
        detect=flux_converters.is_flux_checkpoint,
        open=open_flux,
        config_to_json=lambda c: c.to_json(),
        config_from_json=flux.FluxConfig.from_json,
        abstract_model=flux.abstract_model,
        wrap=FluxForward,
    )


register_family(_flux_family())


# --------------------------------------------------------------------------------------------------------
# Wan 2.1
# --------------------------------------------------------------------------------------------------------


class WanForward:
    """A Wan 2.1 transformer on a mesh, called like diffusers' ``WanTransformer3DModel.forward``.

    ``hidden_states`` [B, C, F, H, W] latents (C = 16, or 36 for I2V: noise, mask, condition),
    ``timestep`` [B] (or a scalar) in [0, 1000), ``encoder_hidden_states`` [B, T, 4096] umT5 tokens
    (the original model zero-pads them to 512), ``encoder_hidden_states_image`` [B, 257, 1280] CLIP
    features for I2V, None for T2V. numpy or jax arrays; returns [B, 16, F, H, W] as an fp32 jax array
    (as the original model does). Any F, H, W that the patch divides: the video tokens are padded for the
    mesh and the padding removed.
    """

    def __init__(
        self,
        model: nnx.Module,
        mesh: Mesh,
        *,
        kernel: Mapping[str, int] | None = None,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> None:
        from jaxdit.models import wan

        self.config = model.config
        self.mesh = mesh
        self.dtype = model.dtype
        self.forward = wan.sharded(model, mesh, kernel=kernel, compiler_options=compiler_options)

    @property
    def params(self) -> nnx.State:
        return self.forward.state

    def __call__(
        self,
        hidden_states: Any,
        timestep: Any,
        encoder_hidden_states: Any,
        encoder_hidden_states_image: Any = None,
    ) -> jax.Array:
        from jaxdit.models import wan

        cfg = self.config
        shape = np.shape(hidden_states)
        if len(shape) != 5 or shape[1] != cfg.in_channels:
            raise ValueError(f"hidden_states has shape {shape}; expected [B, {cfg.in_channels}, F, H, W]")
        batch = shape[0]
        t = _as_float(timestep, jnp.float32)
        if t.ndim == 0:
            t = t.reshape(1)
        if t.shape == (1,) and batch > 1:
            t = jnp.broadcast_to(t, (batch,)) if isinstance(t, jax.Array) else np.broadcast_to(t, (batch,))
        if t.shape != (batch,):
            raise ValueError(f"timestep has shape {t.shape}; expected ({batch},) or a scalar")
        grid = wan.latent_grid(shape, cfg.patch_size)
        image = encoder_hidden_states_image
        out = self.forward(
            hidden_states=wan.patchify(_as_float(hidden_states, self.dtype), cfg.patch_size),
            positions=wan.token_positions(grid),
            timestep=t,
            encoder_hidden_states=_as_float(encoder_hidden_states, self.dtype),
            encoder_hidden_states_image=None if image is None else _as_float(image, self.dtype),
        )
        return wan.unpatchify(out, grid, cfg.patch_size, cfg.out_channels)


def _wan_family() -> Family:
    from converters import wan as wan_converters
    from jaxdit.models import wan

    def open_wan(path: Path, config: Any) -> Source:
        ckpt = wan_converters.detect(path, config)
        return Source(ckpt.config, ckpt.dtype, ckpt.resolve)

    return Family(
        name="wan",
        detect=wan_converters.is_wan_checkpoint,
        open=open_wan,
        config_to_json=lambda c: c.to_json(),
        config_from_json=wan.WanConfig.from_json,
        abstract_model=wan.abstract_model,
        wrap=WanForward,
    )


register_family(_wan_family())
