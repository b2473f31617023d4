"""Checks on weights as they load: floating-point dtypes only, finite values, per-array checksums.

Three ways a checkpoint gives wrong pictures without an error, and what catches each:

- an integer or boolean tensor where a weight belongs (a hand-edited file, a buffer saved by mistake):
  :func:`is_floating` is checked on every source tensor's dtype before anything is read, and
  :func:`check_compute_dtype` refuses a ``dtype=`` that is not a floating-point compute dtype;
- NaN or inf in a weight (a bad fine-tune, a value beyond float16's range): :func:`scan` runs one
  program over the placed parameters in which every device reduces its own shards to "all finite" flags
  (small shards are checked on the host instead, see :data:`HOST_CHECK_MAX_BYTES`);
- damaged data files of a converted checkpoint (a flipped byte inside zstd's raw blocks decodes to a wrong
  value without any error): :func:`scan` also computes a per-array checksum, compared with the one
  ``jaxdit convert`` recorded.

The checksum is a sum, modulo 2**32, over every element of ``fmix32(bits ^ index * 0x9E3779B9)``: ``bits``
the element's bit pattern in the stored dtype, ``index`` its row-major position in the whole array, and
``fmix32`` MurmurHash3's 32-bit finaliser (Appleby, smhasher ``MurmurHash3.cpp``), a bijection. For a
fixed position the term is a bijection of the bits, so any change to one element changes the sum; mixing in
the position makes moved or swapped blocks change it too (other damage escapes with probability ~2**-32).
Because integer addition modulo 2**32 does not depend on order, each device sums its own shard (a
single-device program that is given the shard's offset in the global array) and the host adds the partial
sums: the same checksum comes out whatever mesh or sharding the checkpoint is restored onto, with no
gather of the data to one place and no second read of the files.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from converters.errors import CheckpointError

__all__ = [
    "CHECKSUM_ALGORITHM",
    "COMPUTE_DTYPES",
    "HOST_CHECK_MAX_BYTES",
    "check_compute_dtype",
    "checksum",
    "is_floating",
    "is_exact_widening",
    "nonfinite_summary",
    "raise_if_nonfinite",
    "scan",
]

#: Recorded in a converted checkpoint beside its checksums; a different algorithm is not verified.
CHECKSUM_ALGORITHM = "fmix32-sum-v1"

#: The dtypes a model can compute in (float64 only with ``jax_enable_x64``).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")

_ML_FLOATS = frozenset(
    np.dtype(getattr(ml_dtypes, name))
    for name in dir(ml_dtypes)
    if name == "bfloat16" or (name.startswith("float") and isinstance(getattr(ml_dtypes, name), type))
)


def is_floating(dtype: Any) -> bool:
    """Whether ``dtype`` is a floating-point type (numpy's, or bfloat16 / float8 from ml_dtypes)."""
    dt = np.dtype(dtype)
    return dt.kind == "f" or dt in _ML_FLOATS


def check_compute_dtype(dtype: Any, what: str = "dtype") -> None:
    """Refuse a ``dtype=`` argument that is not a floating-point compute dtype (None passes: default).

    Integer, boolean and float8 dtypes would silently cast the weights (float8 is a storage format, not
    one the model computes in); float64 needs ``jax_enable_x64``, without which jax would quietly use
    float32.
    """
    if dtype is None:
        return
    import jax
    import jax.numpy as jnp

    allowed = COMPUTE_DTYPES + (("float64",) if jax.config.jax_enable_x64 else ())
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in allowed:
        shown = repr(dtype) if name is None else name
        raise ValueError(
            f"{what}={shown} is not a floating-point dtype a model can compute in; use one of "
            f"{', '.join(allowed)}"
        )


def is_exact_widening(stored: Any, target: Any) -> bool:
    """Whether every value of ``stored`` is exactly representable in ``target`` (so a cast back is exact)."""
    stored, target = np.dtype(stored), np.dtype(target)
    if stored == target:
        return True
    if not (is_floating(stored) and is_floating(target)):
        return False
    s, t = ml_dtypes.finfo(stored), ml_dtypes.finfo(target)
    return t.nmant >= s.nmant and t.maxexp >= s.maxexp and t.minexp <= s.minexp


# --------------------------------------------------------------------------------------------------------
# Finiteness and checksums: per shard, on its device (or on the host for small shards)
# --------------------------------------------------------------------------------------------------------

#: Shards up to this size are checked on the host (copied there, numpy): compiling a device program
#: costs ~0.1 s per shape, more than a few MiB take to check in numpy. Larger shards never leave their
#: devices. Both paths give the same checksum (tests/test_reliability_checks.py holds them to it).
HOST_CHECK_MAX_BYTES = 4 << 20

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_GOLDEN = 0x9E3779B9


def _fmix32(h: Any) -> Any:
    """MurmurHash3's finaliser on uint32 values (numpy or jax): a bijection that mixes every bit."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _bits(dtype: np.dtype) -> Any:
    if dtype.itemsize not in _UINT:
        raise ValueError(f"no checksum for {dtype.itemsize}-byte elements ({dtype})")
    return _UINT[dtype.itemsize]


def _device_shard_checksum(x: Any, base: Any, offsets: Any, dims: Any, stored: str) -> Any:
    """The checksum's partial sum over ``x``, a block of a global array of shape ``dims`` starting at
    ``offsets``, its row-major positions shifted by ``base`` (the position of its leading coordinates
    when ``x`` is one layer of a stacked shard). All uint32 and passed at run time: one compile per local
    shape and dtype serves every shard, layer and array of that shape."""
    import jax.numpy as jnp
    from jax import lax

    dtype = np.dtype(stored)
    x = x.astype(dtype) if x.dtype != dtype else x
    bits = lax.bitcast_convert_type(x, _bits(dtype)).astype(jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)  # row-major position in the global array, wrapping
    for axis in range(x.ndim):
        index = index * dims[axis] + (lax.broadcasted_iota(jnp.uint32, x.shape, axis) + offsets[axis])
    return jnp.sum(_fmix32(bits ^ ((index + base) * np.uint32(_GOLDEN))), dtype=jnp.uint32)


def _layer(x: Any, i: Any) -> Any:
    from jax import lax

    return lax.dynamic_index_in_dim(x, i, keepdims=False)


def _host_shard_checksum(x: np.ndarray, offsets: np.ndarray, dims: np.ndarray, stored: str) -> int:
    """:func:`_device_shard_checksum` in numpy (uint32 arithmetic wraps the same way)."""
    dtype = np.dtype(stored)
    x = x.astype(dtype) if x.dtype != dtype else x
    bits = np.ascontiguousarray(x).view(_bits(dtype)).astype(np.uint32)
    index = np.zeros(x.shape, np.uint32)
    for axis, size in enumerate(x.shape):
        shape = [1] * x.ndim
        shape[axis] = size
        iota = np.arange(size, dtype=np.uint32).reshape(shape) + offsets[axis]
        index = index * dims[axis] + iota
    with np.errstate(over="ignore"):
        terms = _fmix32(bits ^ (index * np.uint32(_GOLDEN)))
    return int(np.sum(terms, dtype=np.uint64) % 2**32)


@functools.lru_cache(maxsize=1)
def _device_checksum_program() -> Callable[..., Any]:
    import jax

    return jax.jit(_device_shard_checksum, static_argnums=4)


@functools.lru_cache(maxsize=1)
def _layer_program() -> Callable[..., Any]:
    import jax

    return jax.jit(_layer)


def _device_checksum(data: Any, offsets: np.ndarray, dims: np.ndarray, stored: str) -> int:
    """The partial sum of one shard on its device. A stacked shard ([layers, ...]) is summed one layer at
    a time, each waited for: XLA's CPU backend materialises an integer reduction's operand (4 bytes an
    element; measured 10.5 GiB for Wan 14B's largest stack at once), and one layer bounds it."""
    program = _device_checksum_program()
    if data.ndim < 3:
        return int(program(data, np.uint32(0), offsets, dims, stored))
    stride = int(np.prod(dims[1:], dtype=np.uint64)) % 2**32
    total = 0
    for i in range(data.shape[0]):
        base = np.uint32((i + int(offsets[0])) * stride % 2**32)
        total += int(program(_layer_program()(data, i), base, offsets[1:], dims[1:], stored))
    return total % 2**32


def _own_shards(x: Any) -> list[Any]:
    """The addressable shards of ``x``, one per distinct block (replicas left out)."""
    return [s for s in x.addressable_shards if s.replica_id == 0]


def _is_small(x: Any) -> bool:
    shard = x.sharding.shard_shape(x.shape)
    return int(np.prod(shard)) * np.dtype(x.dtype).itemsize <= HOST_CHECK_MAX_BYTES


def _across_processes(values: np.ndarray, combine: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``combine`` over every process's ``values`` (axis 0); a no-op with one process."""
    import jax

    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return combine(np.asarray(multihost_utils.process_allgather(values)))


def checksum(x: Any, stored: Any) -> str:
    """The checksum of the jax array ``x`` (any sharding) as 8 hex digits, on the values cast to ``stored``.

    Each shard is summed where it is (one copy of replicated blocks); the host adds the partial sums
    modulo 2**32, and processes add theirs, so the result does not depend on the sharding.
    """
    stored = np.dtype(stored).name
    dims = np.asarray(x.shape, np.uint32)
    small = _is_small(x)
    parts = []
    for shard in _own_shards(x):
        offsets = np.asarray([s.start or 0 for s in shard.index], np.uint32)
        if small:
            parts.append(_host_shard_checksum(np.asarray(shard.data), offsets, dims, stored))
        else:
            parts.append(_device_checksum(shard.data, offsets, dims, stored))
    total = np.asarray(sum(int(p) for p in parts) % 2**32, np.uint64)
    if not x.is_fully_addressable:
        total = _across_processes(total, lambda all_: np.sum(all_, dtype=np.uint64) % 2**32)
    return f"{int(total):08x}"


def _all_finite(x: Any) -> Any:
    # max(|x|) is finite exactly when every element is: on one device XLA's max propagates NaN (across
    # devices a collective's max may drop it, so this only ever reduces one device's data). It reduces
    # without temporaries (a sum of x * 0 does not, on XLA's CPU backend, with many arrays per program).
    import jax.numpy as jnp

    return jnp.isfinite(jnp.max(jnp.abs(x)))


@functools.lru_cache(maxsize=16)
def _finite_on_mesh(mesh: Any, specs: tuple[Any, ...]) -> Callable[..., Any]:
    """One program for arrays sharded over ``mesh``: each device reduces its own shards, with no
    collective; the result [devices, arrays] holds every device's flags."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    def local(*shards: Any) -> Any:
        return jnp.stack([_all_finite(x) for x in shards])[None]

    every_device = PartitionSpec(tuple(mesh.axis_names))
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=every_device, check_vma=False))


@functools.lru_cache(maxsize=1)
def _finite_on_one_device() -> Callable[..., Any]:
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda arrays: jnp.stack([_all_finite(x) for x in arrays]))


def _device_finite(leaves: Sequence[Any]) -> list[bool]:
    """Finiteness of arrays checked where their shards are: one program when they share a mesh (or one
    device), else one per shard."""
    import jax

    shardings = [x.sharding for x in leaves]
    mesh = getattr(shardings[0], "mesh", None)
    if all(isinstance(s, jax.sharding.NamedSharding) and s.mesh == mesh for s in shardings):
        flags = _finite_on_mesh(mesh, tuple(s.spec for s in shardings))(*leaves)
        ok = np.all(np.concatenate([np.asarray(s.data) for s in flags.addressable_shards]), axis=0)
    elif len({d for x in leaves for d in x.devices()}) == 1:
        ok = np.asarray(_finite_on_one_device()(list(leaves)))
    else:
        program = _finite_on_one_device()
        ok = np.asarray([all(bool(program([s.data])[0]) for s in _own_shards(x)) for x in leaves])
    if not all(x.is_fully_addressable for x in leaves):
        ok = _across_processes(ok, lambda all_: np.all(all_, axis=0))
    return [bool(f) for f in ok]


def _to_host(x: Any) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))  # replicated: every process holds all of it


def _host_finite(x: Any) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(s.data)))) for s in _own_shards(x))


def scan(
    arrays: Mapping[str, Any], stored_dtypes: Mapping[str, Any] | None = None
) -> tuple[dict[str, bool], dict[str, str]]:
    """Check ``arrays`` (jax arrays, any sharding): whether each is all finite, and (for the names in
    ``stored_dtypes``) its checksum, computed on the values cast to that dtype.

    Arrays with shards larger than :data:`HOST_CHECK_MAX_BYTES` are checked on their devices, each device
    reducing only its own shards (no collectives): finiteness by one program over all of them (one launch,
    one compile per model structure and sharding), checksums by one single-device program per shard
    (one compile per local shape; temporaries bounded by one shard, since XLA's CPU backend materialises
    an integer reduction's operand). Smaller ones on the host. Returns
    ``({name: all finite}, {name: 8 hex digits})``.
    """
    finite: dict[str, bool] = {}
    large = [n for n in arrays if arrays[n].size and not _is_small(arrays[n])]
    if large:
        finite.update(zip(large, _device_finite([arrays[n] for n in large]), strict=True))
    small = [n for n in arrays if n not in finite]
    if small:
        flags = np.asarray([_host_finite(arrays[n]) for n in small])
        if not all(arrays[n].is_fully_addressable for n in small):
            flags = _across_processes(flags, lambda all_: np.all(all_, axis=0))
        finite.update(zip(small, map(bool, flags), strict=True))
    sums = {n: checksum(arrays[n], stored_dtypes[n]) for n in arrays if n in (stored_dtypes or {})}
    return {n: finite[n] for n in arrays}, sums


# --------------------------------------------------------------------------------------------------------
# Reporting non-finite weights
# --------------------------------------------------------------------------------------------------------


def nonfinite_summary(array: Any) -> str:
    """How many NaN and inf values ``array`` holds (and, for a stacked [layers, ...] array, in which
    layers), computed on its devices; only called once a check has failed."""
    import jax.numpy as jnp

    nan = int(_to_host(jnp.sum(jnp.isnan(array))))
    inf = int(_to_host(jnp.sum(jnp.isinf(array))))
    parts = [f"{nan} NaN" if nan else "", f"{inf} inf" if inf else ""]
    text = " and ".join(p for p in parts if p) + f" of {array.size} values"
    if array.ndim >= 2 and array.shape[0] > 1:
        bad = _to_host(jnp.any(~jnp.isfinite(array), axis=tuple(range(1, array.ndim))))
        layers = [int(i) for i in np.flatnonzero(bad)]
        text += f", in layer(s) {', '.join(map(str, layers[:8]))}{' ...' if len(layers) > 8 else ''}"
    return text


def raise_if_nonfinite(
    arrays: Mapping[str, Any],
    finite: Mapping[str, bool],
    where: str,
    explain: Callable[[str], str] | None = None,
) -> None:
    """Raise a CheckpointError naming every parameter of ``arrays`` whose ``finite`` flag is False.

    ``where`` names the checkpoint; ``explain(name)`` may add what the checkpoint holds for it (e.g. the
    source tensors with the non-finite values, or that the values overflowed the dtype they were cast to).
    """
    bad = [n for n, ok in finite.items() if not ok]
    if not bad:
        return
    lines = []
    for name in bad[:5]:
        line = f"  {name} ({arrays[name].dtype}): {nonfinite_summary(arrays[name])}"
        if explain is not None:
            extra = explain(name)
            line += f"; {extra}" if extra else ""
        lines.append(line)
    more = f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise CheckpointError(
        f"{where}: {len(bad)} parameter(s) hold NaN or inf values, which would make every output NaN "
        "(a damaged or badly fine-tuned checkpoint, or values beyond the range of the dtype loaded):\n"
        + "\n".join(lines)
        + more
    )
