"""What loading needs to know about a model family's checkpoints: :class:`CheckpointFormat`.

Each family's converter module (``converters/flux.py``, ``converters/wan.py``) declares one, next to its
key tables: how to recognise its checkpoints, open them (config + the lazy tensors of the key table),
write and read its config in a converted (orbax) checkpoint, and build the abstract model the tensors
fill. ``jaxdit.loading`` reads any checkpoint through it; the family object (``jaxdit.families``)
composes it with the rest of the family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from converters.safetensors_io import LazyTensor

__all__ = ["CheckpointFormat", "Source"]


class Source(Protocol):
    """An opened checkpoint: its model config, storage dtype and the lazy target tensors it gives
    (``resolve(expected shapes by parameter path)``, strict: see ``converters.keymap.resolve``)."""

    config: Any

    @property
    def dtype(self) -> np.dtype: ...

    def resolve(self, expected: Mapping[str, tuple[int, ...]]) -> dict[str, LazyTensor]: ...


@dataclasses.dataclass(frozen=True)
class CheckpointFormat:
    """A family's checkpoints.

    ``name``: the family name an orbax checkpoint records. ``detect(path)``: is ``path`` a (non-orbax)
    checkpoint of this family; cheap (config or headers). ``open(path, config)``: a :class:`Source`;
    ``config`` (or None) overrides the inferred one. ``config_class``: has ``to_json`` / ``from_json``
    (the config in an orbax checkpoint's metadata) and ``num_heads``. ``abstract_model(config, dtype)``:
    the model with ``jax.ShapeDtypeStruct`` parameters.
    """

    name: str
    detect: Callable[[Path], bool]
    open: Callable[[Path, Any], Source]
    config_class: type
    abstract_model: Callable[[Any, Any], Any]

    def config_to_json(self, config: Any) -> dict[str, Any]:
        return config.to_json()

    def config_from_json(self, data: Mapping[str, Any]) -> Any:
        return self.config_class.from_json(data)
