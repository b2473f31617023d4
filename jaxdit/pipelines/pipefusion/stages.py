"""PipeFusion's parameter layout (arXiv 2405.14430): a transformer's block stacks in stage slots.

``jaxdit.parallel.pipefusion.stage_layer_order`` says which layer each slot of a stack holds: P x
ceil(L/P) slots, device s holding slots ``[s k, (s + 1) k)``, padded slots holding zeros. This module
builds a model's parameters in that layout, whatever the family: from a checkpoint (each device reads
only the layers of its own slots), by re-laying out a loaded model, or as shapes only. A family
(``pipefusion/flux.py``, ``pipefusion/wan.py``) subclasses :class:`StagedModel` and names its stacks'
depth fields, its checks and its abstract model; the layout, loading and placement here are the same for
every family. Stack i (in the order the forward runs them, ``STACKS``) is pass i over the stages.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Self

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from converters import orbax_io
from converters.checkpoints import CheckpointFormat
from converters.keymap import place_params
from converters.safetensors_io import LazyTensor
from jaxdit.loading import flat_path as _path
from jaxdit.loading import load_params
from jaxdit.mesh import DeviceMesh, ParallelConfig
from jaxdit.models.partitioning import named_shardings, partition_specs
from jaxdit.parallel.fsdp import shard_stacks
from jaxdit.parallel.pipefusion import stage_layer_order
from sharding_rules import rules_for

__all__ = ["StageOrdered", "StagedModel"]


class StageOrdered(LazyTensor):
    """A stacked checkpoint tensor re-ordered into stage slots (zeros for padded slots), read lazily.

    ``order[slot]`` is the layer the slot holds (-1: padding), as :func:`stage_layer_order` gives it.
    """

    def __init__(self, source: LazyTensor, order: np.ndarray) -> None:
        self._source, self._order = source, order
        self.shape = (len(order), *source.shape[1:])
        self.dtype = source.dtype

    def _read(self, box) -> np.ndarray:
        (lo, hi), rest = box[0], box[1:]
        out = np.zeros(tuple(b - a for a, b in box), self.dtype)
        for i in range(lo, hi):  # a device reads only the layers of its own slots
            if self._order[i] >= 0:
                layer = int(self._order[i])
                out[i - lo] = self._source[(slice(layer, layer + 1), *(slice(a, b) for a, b in rest))][0]
        return out


def _get(state: nnx.State, path: tuple) -> Any:
    node = state
    for key in path:
        node = node[key]
    return node


class StagedModel:
    """A transformer's parameters laid out for PipeFusion on ``mesh``: its stacks in stage slots.

    Every stack named in ``orders`` holds P x ceil(L/P) slots (``orders[stack][slot]`` = layer, -1 for
    padding), split over ``pipefusion`` by ``rules_for(pipefusion=P)``; everything else is replicated (or
    split over ``tensor``). This is no longer the family's plain transformer: build it with
    :meth:`from_model` (re-lays out arrays), :meth:`load` (straight from a checkpoint, each device reading
    its own slots) or :meth:`abstract` (shapes only).

    A subclass names its family and its stacks' depth fields, and gives ``check`` and ``abstract_model``
    (all class-level: they run before an instance exists, to check a config before a tensor is read).
    """

    #: This family's checkpoints (``converters.<family>.CHECKPOINTS``).
    checkpoints: ClassVar[CheckpointFormat]
    #: The error for another family's checkpoint, formatted with ``path`` and ``family``.
    wrong_family: ClassVar[str]
    #: A parameter whose dtype is the model's (norm and modulation tables may be fp32 whatever it is).
    dtype_param: ClassVar[tuple[str, ...]]
    #: Stack name -> the config field holding its number of layers, in the order the forward runs them.
    depth_fields: ClassVar[dict[str, str]]

    @staticmethod
    def check(config: Any, parallel: ParallelConfig) -> None:
        """Raise ValueError for a model this mesh cannot run with PipeFusion."""
        raise NotImplementedError

    @classmethod
    def stack_orders(cls, config: Any, stages: int) -> dict[str, np.ndarray]:
        """Stack name -> slot -> layer: ``stage_layer_order`` with the stack's pass (its place in the
        forward's order)."""
        return {
            stack: stage_layer_order(getattr(config, field), stages, pass_index)
            for pass_index, (stack, field) in enumerate(cls.depth_fields.items())
        }

    @classmethod
    def padded(cls, config: Any, stages: int) -> Any:
        """The config whose stacks have P x ceil(L/P) layers: the layout's parameter container."""
        pad = lambda n: stages * -(-n // stages)
        return dataclasses.replace(
            config, **{field: pad(getattr(config, field)) for field in cls.depth_fields.values()}
        )

    @staticmethod
    def abstract_model(config: Any, dtype: Any) -> nnx.Module:
        """The family's transformer with ``jax.ShapeDtypeStruct`` parameters."""
        raise NotImplementedError

    def __init__(self, config: Any, state: nnx.State, graphdef: nnx.GraphDef, mesh: Mesh):
        self.config = config
        where = DeviceMesh.of(mesh)  # a DeviceMesh passes through; a jax mesh gives its degrees
        mesh = where.mesh
        self.parallel = where.parallel
        self.check(config, self.parallel)
        self.mesh = mesh
        self.graphdef, self.state = graphdef, state
        self.rules = rules_for(tensor=self.parallel.tensor, pipefusion=self.parallel.pipefusion)
        # Under fsdp a stage's own layers are also split over the non-pipefusion axes (gathered per slot).
        self.param_specs, self.gathers = shard_stacks(
            state, partition_specs(state, self.rules), self.parallel
        )
        self.param_shardings = named_shardings(state, self.rules, mesh, self.parallel)
        self.orders = self.stack_orders(config, self.parallel.pipefusion)

    @property
    def dtype(self) -> Any:
        return _get(self.state, self.dtype_param).get_value().dtype

    @property
    def stages(self) -> int:
        return self.parallel.pipefusion

    @classmethod
    def _container(cls, config: Any, mesh: Mesh, dtype: Any) -> tuple[nnx.GraphDef, nnx.State]:
        stages = DeviceMesh.of(mesh).parallel.pipefusion
        model = cls.abstract_model(cls.padded(config, stages), dtype)
        if tuple(cls.depth_fields) != type(model).STACKS:  # stack i is pass i: the forward's order
            raise TypeError(f"{cls.__name__}.depth_fields {tuple(cls.depth_fields)} != {type(model).STACKS}")
        return nnx.split(model)

    @staticmethod
    def _shardings(abstract: nnx.State, mesh: Mesh) -> nnx.State:
        where = DeviceMesh.of(mesh)
        pc = where.parallel
        return named_shardings(
            abstract, rules_for(tensor=pc.tensor, pipefusion=pc.pipefusion), where.mesh, pc
        )

    @classmethod
    def abstract(cls, config: Any, mesh: Mesh, dtype: Any = jnp.bfloat16) -> Self:
        """Shapes only (``jax.ShapeDtypeStruct`` parameters): for sizes and compiles without weights."""
        cls.check(config, DeviceMesh.of(mesh).parallel)
        graphdef, state = cls._container(config, mesh, dtype)
        return cls(config, state, graphdef, mesh)

    @classmethod
    def from_model(cls, model: nnx.Module, mesh: Mesh) -> Self:
        """Re-lay out a loaded model's arrays into stage slots and place them on ``mesh``."""
        config = model.config
        parallel = DeviceMesh.of(mesh).parallel
        cls.check(config, parallel)
        graphdef, abstract = cls._container(config, mesh, model.dtype)
        orders = cls.stack_orders(config, parallel.pipefusion)
        source = nnx.state(model)

        def relayout(path, var, sharding):
            value = _get(source, path).get_value()
            if path[0] in orders:
                order = orders[path[0]]
                value = jnp.take(jnp.asarray(value), np.maximum(order, 0), axis=0)
                keep = (order >= 0).reshape(-1, *([1] * (value.ndim - 1)))
                value = jnp.where(keep, value, jnp.zeros((), value.dtype))
            return var.replace(jax.device_put(value, sharding.get_value()))

        flat_shardings = dict(nnx.to_flat_state(cls._shardings(abstract, mesh)))
        flat = nnx.to_flat_state(abstract)
        state = nnx.from_flat_state([(p, relayout(p, v, flat_shardings[p])) for p, v in flat])
        return cls(config, state, graphdef, mesh)

    @classmethod
    def load(cls, path: str | Path, mesh: Mesh, dtype: Any = None) -> Self:
        """From a checkpoint of this family: each device reads only its own slots of the stacks.

        The model is checked against the mesh before a tensor is read.
        """
        pc = DeviceMesh.of(mesh).parallel
        return cls._load(path, mesh, dtype, lambda config: cls.check(config, pc))

    @classmethod
    def _load(cls, path: str | Path, mesh: Mesh, dtype: Any, check: Callable[[Any], None]) -> Self:
        """:meth:`load` with ``check(config)`` run on the checkpoint's config before any tensor is read."""
        pc = DeviceMesh.of(mesh).parallel
        if orbax_io.is_orbax_checkpoint(Path(path)):
            # Orbax restores into the checkpoint's own (unpadded) stacks: restore without the layer split,
            # then re-lay out (each device briefly holds every block).
            model = load_params(
                path, mesh, dtype, checkpoints=cls.checkpoints, rules=rules_for(tensor=pc.tensor), check=check
            )
            return cls.from_model(model, mesh)
        if not cls.checkpoints.detect(Path(path)):
            raise ValueError(cls.wrong_family.format(path=path, family="another family's"))
        source = cls.checkpoints.open(Path(path), None)
        config = source.config
        check(config)
        dtype = jnp.dtype(dtype or source.dtype)
        graphdef, abstract = cls._container(config, mesh, dtype)
        orders = cls.stack_orders(config, pc.pipefusion)
        # The checkpoint holds the unpadded stacks: resolve its tensors against the real model's shapes.
        real = nnx.to_flat_state(nnx.state(cls.abstract_model(config, dtype)))
        lazies = source.resolve({_path(p): tuple(v.shape) for p, v in real})
        for key in lazies:
            stack = key.split(".", 1)[0]
            if stack in orders:
                lazies[key] = StageOrdered(lazies[key], orders[stack])
        shardings = {_path(p): s.get_value() for p, s in nnx.to_flat_state(cls._shardings(abstract, mesh))}
        arrays = place_params(lazies, shardings, dtype)
        flat = nnx.to_flat_state(abstract)
        state = nnx.from_flat_state([(p, v.replace(arrays[_path(p)])) for p, v in flat])
        return cls(config, state, graphdef, mesh)

    def param_bytes_per_device(self) -> int:
        """Bytes of parameters one device holds (padded slots included)."""
        total = 0
        leaves = jax.tree.leaves(self.state)
        for x, s in zip(leaves, jax.tree.leaves(self.param_shardings), strict=True):
            total += math.prod(s.shard_shape(tuple(x.shape))) * jnp.dtype(x.dtype).itemsize
        return total
