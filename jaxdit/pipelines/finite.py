"""Non-finite values (NaN, inf) caught where they first appear, so that no wrong picture is ever written.

A NaN anywhere in a generation spreads to every pixel after it: a NaN weight, activations beyond the
dtype's range (float16 overflows at 65504), an extreme guidance scale. Decoded and clipped, NaN pixels
become a black picture that looks like a result. Every stage a generation passes through is checked, and
the first one that produced non-finite values is named in a :class:`NonFiniteError`; nothing after it
runs (no decode, no file):

- ``text encoder``: the prompt embeddings an encoder returned, on the host (:func:`check_arrays`);
  embeddings, latents and conditions a caller passes are checked the same way before any work;
- ``transformer output`` and ``sampler update``: inside the compiled denoising step, each device reduces
  its own shard of the model's prediction and of the updated latents to "all finite" flags
  (:func:`shard_flags`). No collective is added to the step (its collectives stay exactly those of the
  parallel strategies, which tests/test_attention_hlo.py and the plan's --verify count; a cross-device
  max could also turn NaN into a number). The step returns the per-device flags, [devices, 2] booleans;
  :class:`StepWatch` reads each step's flags once they are ready, without waiting for the device, so a
  generation whose weights give NaN stops within a step or two instead of running to the end;
- ``denoising step`` (PipeFusion): its programs run the transformer and the sampler together, so the
  latents and the stale K/V are checked after each warm-up step and after the pipelined phase by a
  separate small program (:func:`array_flags`), again per device;
- ``VAE decode``: the decoded pixels on the host, before they are clipped to bytes or written.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdit.distributed import fetch

__all__ = [
    "KV_STAGE",
    "STEP_STAGES",
    "NonFiniteError",
    "StepWatch",
    "array_flags",
    "check_arrays",
    "check_flags",
    "flags_sharding",
    "shard_flags",
]

#: The stages the plain denoising step flags, in the order they run.
STEP_STAGES = ("transformer output", "sampler update")
#: PipeFusion's warm-up steps: the transformer's attention K/V buffers (checked first), then the latents.
KV_STAGE = "transformer's attention K/V"

#: What usually makes each stage non-finite, for the error message.
_OVERFLOWING_TRANSFORMER = (
    "transformer weights that overflow the compute dtype (try dtype float32), a damaged or badly "
    "fine-tuned checkpoint, or non-finite conditioning"
)
CAUSES = {
    "text encoder": "non-finite or overflowing text-encoder weights (a damaged text_encoder/ checkpoint)",
    "transformer output": _OVERFLOWING_TRANSFORMER,
    KV_STAGE: _OVERFLOWING_TRANSFORMER,
    "sampler update": "an extreme guidance scale or sampler schedule (e.g. flow_shift) for a finite prediction",
    "denoising step": (
        "transformer weights that overflow the compute dtype (try dtype float32), a damaged checkpoint, or an "
        "extreme guidance scale"
    ),
    "VAE decode": "non-finite or overflowing VAE weights (a damaged vae/ checkpoint), or a VAE dtype too narrow",
}


class NonFiniteError(ValueError):
    """A generation produced NaN or inf; ``stage`` names where they first appeared and ``step`` (1-based,
    denoising stages) when. A ValueError, so ``jaxdit generate`` reports it in one line and exits 2."""

    def __init__(
        self,
        stage: str,
        detail: str,
        *,
        step: int | None = None,
        steps: int | None = None,
        devices: Sequence[int] = (),
    ) -> None:
        self.stage, self.step, self.steps, self.devices = stage, step, steps, tuple(devices)
        when = f" at denoising step {step} of {steps}" if step is not None else ""
        where = f" on device(s) {_ranges(self.devices)}" if self.devices else ""
        cause = CAUSES.get(stage)
        super().__init__(
            f"non-finite values (NaN or inf) first appeared in the {stage}{when}{where}: {detail}; nothing "
            "was decoded or written" + (f". Likely cause: {cause}" if cause else "")
        )


def _ranges(ids: Sequence[int]) -> str:
    ids = sorted(ids)
    if len(ids) > 4 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids))


# --------------------------------------------------------------------------------------------------------
# Host arrays: embeddings, given latents, decoded pixels
# --------------------------------------------------------------------------------------------------------


def check_arrays(stage: str, arrays: Mapping[str, Any], *, given: bool = False) -> None:
    """Raise :class:`NonFiniteError` (``given``: ValueError, the caller's input) if any of ``arrays``
    (name -> array or None; numpy or jax) holds NaN or inf."""
    for name, value in arrays.items():
        if value is None:
            continue
        a = np.asarray(value)
        if a.dtype.kind in "biuSUO":  # labels, masks, ids: nothing to check
            continue
        if a.dtype.kind != "f":  # bfloat16 and other ml_dtypes floats
            a = a.astype(np.float32)
        bad = a.size - int(np.count_nonzero(np.isfinite(a)))
        if bad:
            what = f"{name} {tuple(a.shape)} holds {bad} NaN/inf value(s) of {a.size}"
            if given:
                raise ValueError(f"{what}: inputs must be finite")
            raise NonFiniteError(stage, what)


# --------------------------------------------------------------------------------------------------------
# Per-device flags: inside the compiled step, and for placed arrays
# --------------------------------------------------------------------------------------------------------


def flags_sharding(mesh: Mesh) -> NamedSharding:
    """[devices, stages] flags: one row per device, each on its own device (all mesh axes on dim 0)."""
    return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))


def shard_flags(mesh: Mesh, arrays: Sequence[tuple[jax.Array, PartitionSpec]]) -> jax.Array:
    """Inside a jitted program: for each (array, its PartitionSpec), whether this device's shard of it is
    all finite, as [devices, len(arrays)] booleans sharded by :func:`flags_sharding`.

    The specs must be the arrays' own shardings (then nothing moves): each device reduces what it holds,
    and no collective joins the results; the host reads the rows (:func:`check_flags`).
    """

    def local(*shards: jax.Array) -> jax.Array:
        return jnp.stack([jnp.isfinite(s).all() for s in shards])[None]

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(spec for _, spec in arrays),
        out_specs=flags_sharding(mesh).spec,
        check_vma=False,
    )(*(a for a, _ in arrays))


@functools.lru_cache(maxsize=64)
def _flags_program(mesh: Mesh, specs: tuple[PartitionSpec, ...]) -> Any:
    return jax.jit(lambda *xs: shard_flags(mesh, list(zip(xs, specs, strict=True))))


def array_flags(mesh: Mesh, arrays: Sequence[jax.Array]) -> jax.Array:
    """:func:`shard_flags` for placed arrays (each a NamedSharding on ``mesh``), as its own small program:
    [devices, len(arrays)], not waited for."""
    specs = tuple(a.sharding.spec for a in arrays)
    return _flags_program(mesh, specs)(*arrays)


def check_flags(
    flags: Any, mesh: Mesh, stages: Sequence[str], *, step: int | None = None, steps: int | None = None
) -> None:
    """Raise :class:`NonFiniteError` naming the first of ``stages`` (the flags' columns) some device flagged
    and the devices that did. ``step``: 1-based, for the message."""
    flags = np.asarray(fetch(flags), bool)  # across processes too
    if flags.all():
        return
    ids = [d.id for d in mesh.devices.flat]
    column = int(np.argmin(flags.all(axis=0)))
    devices = [ids[row] for row in np.flatnonzero(~flags[:, column])]
    detail = f"{len(devices)} of {len(ids)} devices hold non-finite values in their shard"
    raise NonFiniteError(stages[column], detail, step=step, steps=steps, devices=devices)


class StepWatch:
    """The flags of a denoising loop's steps, read as the device finishes them.

    ``add(step, flags)`` after each step is dispatched: the flags of every step already finished are read
    then (a finished array is read without waiting), so a failing run stops early; ``finish()`` reads the
    rest. The first step (in order) with a flag down raises :class:`NonFiniteError`. Across processes
    the flags are read in :meth:`finish` only (each read is an all-gather every process must join).
    """

    def __init__(self, mesh: Mesh, steps: int, stages: Sequence[str] = STEP_STAGES) -> None:
        self.mesh, self.steps, self.stages = mesh, steps, tuple(stages)
        self.pending: list[tuple[int, jax.Array]] = []

    def add(self, step: int, flags: jax.Array) -> None:
        self.pending.append((step, flags))
        if not flags.is_fully_addressable:
            return  # across processes reading is a collective: every process reads at the same points
        while self.pending and self.pending[0][1].is_ready():
            self._check(*self.pending.pop(0))

    def finish(self) -> None:
        while self.pending:
            self._check(*self.pending.pop(0))

    def _check(self, step: int, flags: jax.Array) -> None:
        check_flags(flags, self.mesh, self.stages, step=step + 1, steps=self.steps)
