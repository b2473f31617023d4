"""The LoRA layouts a model family brings, registered by the family's own ``converters/lora/<family>.py``.

Shared LoRA code (``converters.lora``) looks a model's layouts up here by its config's type and never
names a family; a family's layouts module calls :func:`register_lora_family` when it is imported (the
family object in ``jaxdit/families/`` imports it, so every registered model family has its layouts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from converters.lora.core import LoraLayout

__all__ = ["LORA_FAMILIES", "LoraFamily", "register_lora_family"]


@dataclasses.dataclass(frozen=True)
class LoraFamily:
    """How one family's LoRA files are read: its config type, the key layouts people share for it, a
    quick test of whether keys look like its files (to say "a LoRA of another family"), a one-line
    description of a model (for errors) and the shapes of its parameters."""

    name: str
    config_type: type
    layouts: Callable[[Any], list[LoraLayout]]
    looks_like: Callable[[Iterable[str]], bool]
    describe: Callable[[Any], str]
    parameter_shapes: Callable[[Any], dict[str, tuple[int, ...]]]


#: name -> the family's LoRA layouts, in registration order.
LORA_FAMILIES: dict[str, LoraFamily] = {}


def register_lora_family(family: LoraFamily) -> LoraFamily:
    known = LORA_FAMILIES.get(family.name)
    if known is not None and known != family:
        raise ValueError(f"LoRA layouts for {family.name!r} are registered already")
    LORA_FAMILIES[family.name] = family
    return family
