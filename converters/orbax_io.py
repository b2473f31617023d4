"""Converted parameters as an orbax checkpoint: written atomically, checksummed, restored into shardings.

Layout of a jaxdit checkpoint folder::

    DST/
      jaxdit.json     {"format": 1, "family": "flux", "dtype": "bfloat16", "config": {...},
                       "checksum": "fmix32-sum-v1", "arrays": {"a.kernel": {"shape": [..], "dtype": "..",
                                                                          "checksum": "1f2e3d4c"}, ...}}
      params/         orbax (tensorstore) checkpoint of the nested parameter dict

:func:`save` writes everything into a temporary folder beside DST (see :mod:`converters.destination`) and
renames it to DST at the end, so an interrupted or failed conversion leaves no DST at all.

:func:`restore` reads into ``jax.ShapeDtypeStruct`` targets that carry a sharding: every device reads
only its own shard from disk (orbax/tensorstore). The arrays' names, shapes and dtypes are checked against
``arrays`` before anything is read; afterwards every array is checked where it was restored, each device
reducing its own shards: finite, and matching its checksum (:mod:`converters.checks`). Damaged data files are a
:class:`CheckpointError` naming the array, not a tensorstore traceback. Checkpoints written before
checksums existed (no ``arrays``) load with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from converters import checks, destination
from converters.errors import CheckpointError

__all__ = ["METADATA_FILE", "check_destination", "is_orbax_checkpoint", "read_metadata", "restore", "save"]

METADATA_FILE = "jaxdit.json"
PARAMS_DIR = "params"
FORMAT = 1


def is_orbax_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder written by :func:`save`."""
    path = Path(path)
    return (path / METADATA_FILE).is_file() and (path / PARAMS_DIR).is_dir()


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``jaxdit.json`` of a checkpoint folder (family, dtype, config, per-array checksums)."""
    file = Path(path) / METADATA_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read the checkpoint metadata: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or "family" not in data:
        raise CheckpointError(f"{file}: not a jaxdit checkpoint description (format {FORMAT})")
    arrays = data.get("arrays")
    if arrays is not None and not (
        isinstance(arrays, dict)
        and all(isinstance(a, dict) and {"shape", "dtype", "checksum"} <= a.keys() for a in arrays.values())
    ):
        raise CheckpointError(f"{file}: malformed 'arrays' (each needs shape, dtype and checksum)")
    return data


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict as {"a.b.c": leaf}: the names orbax gives the arrays on disk."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _unflatten(flat: Mapping[str, Any], like: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    return {
        k: _unflatten(flat, v, f"{prefix}{k}.") if isinstance(v, Mapping) else flat[f"{prefix}{k}"]
        for k, v in like.items()
    }


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Keep orbax's failure reports to the caller's one clear error.

    Orbax logs every failure of its background threads with a full traceback, and tensorstore callbacks
    that finish after orbax closed its event loop report "RuntimeError: Event loop is closed" (one
    traceback each, hundreds of lines for a full disk) before the same error reaches the caller. While
    orbax works, absl's log is raised to CRITICAL and those closed-loop reports (only those) are dropped;
    after a failure the filter stays, for callbacks that finish later.
    """
    logger = logging.getLogger("absl")
    level, hook = logger.level, sys.unraisablehook
    logger.setLevel(logging.CRITICAL)
    sys.unraisablehook = _dropping_closed_loop_noise(hook)
    try:
        yield
    except BaseException:
        logger.setLevel(level)
        raise
    logger.setLevel(level)
    sys.unraisablehook = hook


def _dropping_closed_loop_noise(hook: Any) -> Any:
    if getattr(hook, "drops_closed_loop_noise", False):
        return hook

    def filtered(unraisable: Any) -> None:
        value = unraisable.exc_value
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        hook(unraisable)

    filtered.drops_closed_loop_noise = True  # type: ignore[attr-defined]
    return filtered


class _FailedWritesNoise(logging.Filter):
    """Drops asyncio's "... exception was never retrieved" reports about files under ``folder``: when
    several of orbax's reads or writes fail, orbax raises the first and asyncio reports every other one,
    with a traceback, whenever its task or future happens to be collected (now, or at interpreter exit)."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = str(folder)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("exception was never retrieved" in text and self.folder in text)


def _collect_quietly(folder: Path) -> None:
    """After a failed save or restore of ``folder``, collect orbax's abandoned coroutines now, quietly:
    collected later, each would print "Exception ignored in ..." with a TensorStore spec of dozens of
    lines. From here on, asyncio's reports of the same failures and Python's warnings about orbax's
    coroutines that were never awaited are dropped too: the caller reports the failure once."""
    logging.getLogger("asyncio").addFilter(_FailedWritesNoise(folder))
    warnings.filterwarnings("ignore", message=r"coroutine 'async_(de)?serializ\w*", category=RuntimeWarning)
    # Any of orbax's coroutines collected here, by the gc.collect below (their names vary by version).
    warnings.filterwarnings(
        "ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning, module=__name__
    )
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


# --------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------


def check_destination(dst: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Before a conversion reads anything: can :func:`save` write ``dst``? (See
    :func:`converters.destination.check_destination`.) Returns the absolute path."""
    return destination.check_destination(dst, overwrite=overwrite, is_ours=is_orbax_checkpoint)


def save(
    dst: str | os.PathLike[str],
    params: Mapping[str, Any],
    metadata: Mapping[str, Any],
    *,
    overwrite: bool = False,
) -> Path:
    """Write ``params`` (a nested dict of jax arrays), their checksums and ``metadata`` to ``dst``,
    atomically.

    ``dst`` must not exist unless ``overwrite`` (and then be a jaxdit checkpoint or an empty folder); the
    old folder is replaced only once the new one is complete. Write failures (no space, no permission)
    are a :class:`DestinationError`; nothing is left behind.
    """
    import orbax.checkpoint as ocp  # deferred: orbax is slow to import and only needed here

    dst = check_destination(dst, overwrite=overwrite)
    flat = _flatten(params)
    _, sums = checks.scan(flat, {name: x.dtype for name, x in flat.items()})
    arrays = {
        name: {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name, "checksum": sums[name]}
        for name, x in flat.items()
    }
    meta = {"format": FORMAT, **metadata, "checksum": checks.CHECKSUM_ALGORITHM, "arrays": arrays}
    nbytes = sum(x.size * np.dtype(x.dtype).itemsize for x in flat.values())
    error = None
    with destination.staging(dst, overwrite=overwrite) as tmp:
        try:
            with _quiet_orbax(), ocp.StandardCheckpointer() as ckptr:
                ckptr.save(tmp / PARAMS_DIR, dict(params))
                ckptr.wait_until_finished()
            (tmp / METADATA_FILE).write_text(
                json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8"
            )
        except (OSError, ValueError, RuntimeError) as e:
            error = destination.write_error(dst, e, nbytes)
        if error is not None:  # outside the except block, so the failed writers can be collected
            _collect_quietly(tmp)
            raise error
    return dst


# --------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------


def _check_arrays(src: Path, recorded: Mapping[str, Any], target: Mapping[str, Any]) -> None:
    """Names, shapes and dtypes of what is on disk against what the model wants, before any read."""
    missing = [n for n in target if n not in recorded]
    unused = [n for n in recorded if n not in target]
    if missing or unused:
        raise CheckpointError(
            f"{src}: the checkpoint's arrays do not match its model config: missing {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}, not used by the model {unused[:3]}"
            f"{' ...' if len(unused) > 3 else ''}"
        )
    for name, want in target.items():
        have = recorded[name]
        if tuple(have["shape"]) != tuple(want.shape):
            raise CheckpointError(
                f"{src}: array {name!r} has shape {tuple(have['shape'])}; the model config expects "
                f"{tuple(want.shape)}"
            )
        try:
            stored = np.dtype(have["dtype"])
        except TypeError:
            stored = None
        if stored is None or not checks.is_floating(stored):
            raise CheckpointError(f"{src}: array {name!r} is stored as {have['dtype']}, not floating point")


_ARRAY_IN_ERROR = re.compile(r'(?:reading|writing) "([^"/]+)/')


def _read_error(src: Path, error: BaseException) -> CheckpointError:
    """Orbax/tensorstore's error (a generic Exception around a ValueError) as one line naming the array."""
    chain, e = [], error
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    innermost = destination.short_reason(chain[-1])
    for e in chain:
        match = _ARRAY_IN_ERROR.search(str(e))
        if match:
            return CheckpointError(
                f"{src}: array {match.group(1)!r} cannot be read, the checkpoint's data files are damaged or "
                f"incomplete ({innermost}); convert the checkpoint again"
            )
    return CheckpointError(f"{src / PARAMS_DIR}: cannot restore the parameters: {innermost}")


def restore(src: str | os.PathLike[str], target: Mapping[str, Any], *, verify: bool = True) -> dict[str, Any]:
    """Read the parameters of ``src`` into the structure ``target``: a nested dict of
    ``jax.ShapeDtypeStruct`` with ``sharding`` set (each device reads its shard, in the target dtype).

    With ``verify`` (default), every array must be finite and match its recorded checksum. An array
    restored into a dtype that cannot hold its stored values exactly (e.g. float32 stored, bfloat16
    wanted) is read in its stored dtype, verified, then cast on its devices: it briefly takes the stored
    size in device memory.
    """
    import jax
    import orbax.checkpoint as ocp

    src = Path(src).absolute()
    if not is_orbax_checkpoint(src):
        raise CheckpointError(f"{src}: not a jaxdit checkpoint folder ({METADATA_FILE} + {PARAMS_DIR}/)")
    meta = read_metadata(src)
    flat_target = _flatten(target)
    recorded = meta.get("arrays")
    if recorded is not None:
        _check_arrays(src, recorded, flat_target)
    checksummed = verify and recorded is not None and meta.get("checksum") == checks.CHECKSUM_ALGORITHM
    if verify and not checksummed:
        warnings.warn(
            f"{src}: written without per-array checksums (by an older jaxdit): its data is not verified; "
            "convert it again to add them",
            stacklevel=2,
        )
    stored = {n: np.dtype(recorded[n]["dtype"]) for n in flat_target} if checksummed else {}
    # Arrays whose target dtype cannot hold the stored values exactly are read as stored.
    read_as = {
        n: t
        if n not in stored or checks.is_exact_widening(stored[n], t.dtype)
        else jax.ShapeDtypeStruct(t.shape, stored[n], sharding=t.sharding)
        for n, t in flat_target.items()
    }
    error = None
    try:
        with _quiet_orbax(), ocp.StandardCheckpointer() as ckptr:
            flat = _flatten(ckptr.restore(src / PARAMS_DIR, _unflatten(read_as, target)))
    except Exception as e:  # tensorstore and orbax raise bare Exceptions for damaged files
        error = _read_error(src, e)
    if error is not None:
        _collect_quietly(src)
        raise error
    if verify:
        finite, sums = checks.scan(flat, stored)
        wrong = [n for n in sums if sums[n] != recorded[n]["checksum"]]
        if wrong:
            listed = ", ".join(
                f"{n!r} (recorded {recorded[n]['checksum']}, read {sums[n]})" for n in wrong[:3]
            )
            raise CheckpointError(
                f"{src}: {len(wrong)} array(s) do not match their checksums: {listed}"
                f"{' ...' if len(wrong) > 3 else ''}; the checkpoint's data files are damaged: convert it again"
            )
        checks.raise_if_nonfinite(flat, finite, str(src))
    for name in [n for n in flat if flat[n].dtype != flat_target[n].dtype]:
        flat[name] = _cast_program()(flat[name], np.dtype(flat_target[name].dtype).name)
    return _unflatten(flat, target)


@functools.lru_cache(maxsize=1)
def _cast_program() -> Any:
    """``x.astype(dtype)`` on ``x``'s devices, in place of ``x`` (donated)."""
    import jax

    return jax.jit(lambda x, dtype: x.astype(dtype), static_argnums=1, donate_argnums=0)
