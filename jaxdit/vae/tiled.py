"""A VAE split for compiled row-parallel programs over the tile mesh (:func:`spatial.tile_mesh`): the
module's graph and state, its compiled programs cached per (devices, shape, dtype, ...), its state
replicated once per set of devices. Wan's and HunyuanVideo 1.5's VAEs build on it."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdit.vae import spatial

__all__ = ["TiledPrograms", "device_key"]


def device_key(tiles: Mesh) -> tuple[int, ...]:
    """The tile mesh's devices, in order: what a cached program or state is keyed by."""
    return tuple(d.id for d in tiles.devices.flat)


class TiledPrograms:
    """``module`` (an nnx VAE, possibly abstract) split into graph and state, with cached programs."""

    def __init__(self, module: nnx.Module, *, compiler_options: Mapping[str, Any] | None = None) -> None:
        self.config = module.config
        self.graphdef, self.state = nnx.split(module)
        self.dtype = jnp.dtype(jax.tree.leaves(self.state)[0].dtype)
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self._compiled: dict[Any, Any] = {}
        self._states: dict[Any, Any] = {}

    @staticmethod
    def tiles(mesh: Mesh | None) -> Mesh:
        """The 1-D tile mesh the programs run on: all devices of ``mesh``, or the first device."""
        return spatial.tile_mesh(mesh if mesh is not None else jax.devices()[:1])

    def _compile(self, key: Hashable, tiles: Mesh, program: Callable, x: jax.ShapeDtypeStruct) -> Any:
        """``program(state, x)`` jitted and compiled for the replicated state and input ``x`` (with its
        sharding), cached under ``key`` and the tiles' devices."""
        key = (key, device_key(tiles))
        if key not in self._compiled:
            replicated = NamedSharding(tiles, PartitionSpec())
            state = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), self.state
            )
            fn = jax.jit(program, compiler_options=self.compiler_options)
            self._compiled[key] = fn.lower(state, x).compile()
        return self._compiled[key]

    def _state_on(self, tiles: Mesh) -> Any:
        """The state replicated on the tiles (once per set of devices)."""
        key = device_key(tiles)
        if key not in self._states:
            self._states[key] = jax.device_put(self.state, NamedSharding(tiles, PartitionSpec()))
        return self._states[key]
