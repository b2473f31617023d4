"""ParallelConfig: the degrees of each parallel strategy, validated, and the device mesh they make.

The mesh axes, outer to inner, are ``data, cfg, pipefusion, ring, ulysses, tensor`` (xDiT nests its
process groups the same way: tensor innermost, then sequence parallel with Ulysses inside Ring, then
PipeFusion, CFG and data outermost). Inner axes exchange data in every layer, so they should land on
neighbouring devices (same host, NVLink); outer axes tolerate slower links. Size-1 axes stay in the
mesh so that no code has to branch on whether an axis exists.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

#: Mesh axis names, outer to inner.
MESH_AXES: tuple[str, ...] = ("data", "cfg", "pipefusion", "ring", "ulysses", "tensor")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Degrees of parallelism for one generation; their product is the number of devices used.

    ``data``: independent requests (throughput only). ``cfg``: the conditional and unconditional
    halves of classifier-free guidance (1 or 2). ``pipefusion``: PipeFusion stages over the stacked
    blocks. ``ring``/``ulysses``: sequence parallelism (USP when both are > 1). ``tensor``:
    Megatron-style heads/MLP split. ``fsdp``: the stacked blocks' weights sharded over mesh axes and
    gathered one layer at a time (``jaxdit.parallel.fsdp``): False, True (every axis but data and cfg),
    or the axis names to shard over. Not a degree: it uses no devices of its own.
    """

    data: int = 1
    cfg: int = 1
    pipefusion: int = 1
    ring: int = 1
    ulysses: int = 1
    tensor: int = 1
    fsdp: bool | tuple[str, ...] = False

    def __post_init__(self) -> None:
        if not isinstance(self.fsdp, bool):
            axes = (self.fsdp,) if isinstance(self.fsdp, str) else tuple(self.fsdp)
            unknown = [a for a in axes if a not in MESH_AXES]
            if unknown or not axes:
                raise ValueError(
                    f"ParallelConfig.fsdp={self.fsdp!r}: expected True/False or mesh axes from {MESH_AXES}"
                )
            object.__setattr__(self, "fsdp", axes)
        for name in MESH_AXES:
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or isinstance(value, bool):
                raise TypeError(f"ParallelConfig.{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"ParallelConfig.{name} must be >= 1, got {value}")
        if self.cfg not in (1, 2):
            raise ValueError(
                f"cfg degree must be 1 or 2 (there are only two guidance branches), got cfg={self.cfg}; "
                f"use cfg=2 and put the remaining factor of {self.cfg // 2 or 1} on ulysses or ring"
            )

    # ------------------------------------------------------------------ sizes
    @property
    def degrees(self) -> dict[str, int]:
        """Axis name -> degree, outer to inner."""
        return {name: getattr(self, name) for name in MESH_AXES}

    @property
    def num_devices(self) -> int:
        return math.prod(self.degrees.values())

    @property
    def sequence_degree(self) -> int:
        """Number of sequence shards: ring x ulysses."""
        return self.ring * self.ulysses

    @property
    def head_degree(self) -> int:
        """Number of ways attention heads are split inside attention: ulysses x tensor."""
        return self.ulysses * self.tensor

    def describe(self) -> str:
        parts = [f"{k}{v}" for k, v in self.degrees.items() if v > 1]
        text = " x ".join(parts) if parts else "single device"
        return text + " + fsdp" if self.fsdp else text

    # ------------------------------------------------------------- validation
    def validate_devices(self, num_devices: int) -> None:
        """Raise unless the degrees multiply to ``num_devices``."""
        if self.num_devices != num_devices:
            nonunit = ", ".join(f"{k}={v}" for k, v in self.degrees.items() if v > 1) or "all degrees 1"
            examples = [f"ulysses={num_devices}", f"ring={num_devices}"]
            if num_devices % 2 == 0 and num_devices > 2:
                examples.append(f"cfg=2 x ulysses={num_devices // 2}")
            raise ValueError(
                f"the parallel degrees ({nonunit}) multiply to {self.num_devices} devices, but "
                f"{num_devices} devices are given; the product must equal the device count "
                f"(for example {', or '.join(examples)})"
            )

    def validate_heads(self, num_heads: int) -> None:
        """Raise unless ``num_heads`` splits over ulysses x tensor."""
        if num_heads % self.head_degree:
            valid_u = [u for u in _divisors(num_heads) if num_heads % (u * self.tensor) == 0]
            raise ValueError(
                f"{num_heads} heads cannot be split over ulysses={self.ulysses} x tensor={self.tensor}; "
                f"with tensor={self.tensor} valid ulysses degrees are {', '.join(map(str, valid_u))} "
                f"(ring has no head constraint: put the rest of the sequence split on ring)"
            )

    def validate_model(self, num_heads: int) -> None:
        """Checks that need the model: heads over ulysses x tensor."""
        self.validate_heads(num_heads)

    # ------------------------------------------------------------------- mesh
    def make_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The device mesh, axes ``MESH_AXES``; all axes are Auto so jit and shard_map mix freely.

        ``devices`` defaults to all devices (of every process). Their order is kept: the last
        (innermost) axis varies fastest, so neighbouring devices share tensor and ulysses groups.
        """
        devs = list(jax.devices() if devices is None else devices)
        self.validate_devices(len(devs))
        grid = np.empty(len(devs), dtype=object)
        grid[:] = devs
        shape = tuple(self.degrees.values())
        return Mesh(grid.reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))

    @classmethod
    def from_mesh(cls, mesh: Mesh) -> ParallelConfig:
        """The config a mesh was made from (its axis sizes)."""
        missing = [a for a in MESH_AXES if a not in mesh.shape]
        if missing:
            raise ValueError(
                f"mesh axes {tuple(mesh.axis_names)} lack {missing}; build meshes with ParallelConfig"
            )
        return cls(**{a: int(mesh.shape[a]) for a in MESH_AXES})

    def device_mesh(self, devices: Sequence[jax.Device] | None = None) -> DeviceMesh:
        """:meth:`make_mesh` together with this config: the one object a run passes on."""
        return DeviceMesh(self.make_mesh(devices), self)


@dataclasses.dataclass(frozen=True, eq=False)
class DeviceMesh:
    """A device mesh and the :class:`ParallelConfig` it was made from, built once and passed on.

    Everything below ``jaxdit generate``, ``jaxdit serve``, ``jaxdit plan --verify`` and the pipelines
    needs both: ``mesh`` for jax (shardings, ``shard_map``) and ``parallel`` for the degrees. Functions
    that take a mesh take either a :class:`jax.sharding.Mesh` or this (:data:`MeshLike`) and read it with
    :meth:`of`, which reads a plain mesh's degrees (the only place that does) and passes this object
    through unchanged.
    """

    mesh: Mesh
    parallel: ParallelConfig

    @classmethod
    def of(cls, where: MeshLike | ParallelConfig | None) -> DeviceMesh:
        """``where`` as a DeviceMesh: itself; a mesh with its degrees; a config's mesh on the first
        ``num_devices`` devices (e.g. one device of eight); one device for None."""
        if isinstance(where, DeviceMesh):
            return where
        if isinstance(where, Mesh):
            return cls(where, ParallelConfig.from_mesh(where))
        if where is None:
            return single_device(None)
        devices = jax.devices()
        return where.device_mesh(
            devices[: where.num_devices] if where.num_devices < len(devices) else devices
        )


#: What a function that runs on a mesh takes: a jax mesh (made by ``ParallelConfig.make_mesh``) or a
#: :class:`DeviceMesh`.
MeshLike = Mesh | DeviceMesh


def single_device(device: jax.Device | None = None) -> DeviceMesh:
    """One device with every axis of size 1 (the unsharded reference)."""
    return ParallelConfig().device_mesh([device or jax.devices()[0]])


def single_device_mesh(device: jax.Device | None = None) -> Mesh:
    """A mesh of one device with every axis of size 1 (the unsharded reference)."""
    return single_device(device).mesh


def mesh_for(parallel: ParallelConfig | MeshLike | None) -> Mesh:
    """The jax mesh of ``parallel`` (see :meth:`DeviceMesh.of`)."""
    return DeviceMesh.of(parallel).mesh
