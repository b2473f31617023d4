"""Converted parameters as an orbax checkpoint: written atomically, restored straight into shardings.

Layout of a jaxdit checkpoint folder::

    DST/
      jaxdit.json     {"format": 1, "family": "flux", "dtype": "bfloat16", "config": {...}}
      params/         orbax (tensorstore) checkpoint of the nested parameter dict

:func:`save` writes everything into a temporary folder beside DST and renames it to DST at the end, so an
interrupted or failed conversion leaves no DST at all (the temporary folder is removed on failure; one
left by a killed process is named ``.DST.tmp-*`` and is never mistaken for a checkpoint).

:func:`restore` reads into ``jax.ShapeDtypeStruct`` targets that carry a sharding: every device reads
only its own shard from disk (orbax/tensorstore), in the target dtype.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from converters.errors import CheckpointError

__all__ = ["METADATA_FILE", "is_orbax_checkpoint", "read_metadata", "restore", "save"]

METADATA_FILE = "jaxdit.json"
PARAMS_DIR = "params"
FORMAT = 1


def is_orbax_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder written by :func:`save`."""
    path = Path(path)
    return (path / METADATA_FILE).is_file() and (path / PARAMS_DIR).is_dir()


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``jaxdit.json`` of a checkpoint folder (family, dtype, config)."""
    file = Path(path) / METADATA_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read the checkpoint metadata: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or "family" not in data:
        raise CheckpointError(f"{file}: not a jaxdit checkpoint description (format {FORMAT})")
    return data


def save(
    dst: str | os.PathLike[str],
    params: Mapping[str, Any],
    metadata: Mapping[str, Any],
    *,
    overwrite: bool = False,
) -> Path:
    """Write ``params`` (a nested dict of arrays) and ``metadata`` to the folder ``dst``, atomically.

    ``dst`` must not exist unless ``overwrite``; then the old folder is replaced only once the new one is
    complete.
    """
    import orbax.checkpoint as ocp  # deferred: orbax is slow to import and only needed here

    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{secrets.token_hex(6)}"
    try:
        tmp.mkdir()
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / PARAMS_DIR, dict(params))
            ckptr.wait_until_finished()
        meta = {"format": FORMAT, **metadata}
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if dst.exists():
            old = dst.parent / f".{dst.name}.old-{secrets.token_hex(6)}"
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise
    return dst


def restore(src: str | os.PathLike[str], target: Mapping[str, Any]) -> dict[str, Any]:
    """Read the parameters of ``src`` into the structure ``target``: a nested dict of
    ``jax.ShapeDtypeStruct`` with ``sharding`` set (each device reads its shard, cast to the target dtype).
    """
    import orbax.checkpoint as ocp

    src = Path(src).absolute()
    if not is_orbax_checkpoint(src):
        raise CheckpointError(f"{src}: not a jaxdit checkpoint folder ({METADATA_FILE} + {PARAMS_DIR}/)")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(src / PARAMS_DIR, dict(target))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"{src / PARAMS_DIR}: cannot restore the parameters: {e}") from e
