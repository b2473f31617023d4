"""LoRA files -> updates of jaxdit parameters: :func:`read_lora` detects the layout and checks the file.

A LoRA adds ``scale x (alpha / rank) x up @ down`` to a linear weight (Hu et al., arXiv 2106.09685). Files
come in several key layouts (``converters/lora/flux.py`` and ``wan.py`` list them); :func:`read_lora` tries
each layout of the model's family, takes the one that reads every key, and returns the updates of jaxdit's
parameters (:class:`LowRankUpdate` factors or :class:`DeltaUpdate` full deltas, fp32, on the host). Nothing
touches a device: ``jaxdit.lora`` fuses the updates into the weights on the mesh.

Only safetensors files are read (no pickle). Errors (:class:`LoraError`) name the file and the key: a LoRA
for another family or model size, an unknown layout, a rank mismatch, NaN/inf values, a missing ``.alpha``
where the layout needs one, text-encoder or DoRA/LoKr weights (not fused here).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from converters.lora.core import (
    DeltaUpdate,
    LoraError,
    LoraLayout,
    LowRankUpdate,
    convert_modules,
    parse_keys,
    peft_metadata,
)
from converters.lora.family import LORA_FAMILIES, LoraFamily, register_lora_family
from converters.safetensors_io import SafetensorsFile

__all__ = [
    "DeltaUpdate",
    "LoraError",
    "LoraFamily",
    "LoraFile",
    "LowRankUpdate",
    "family_of",
    "read_lora",
    "register_lora_family",
]

PathLike = str | os.PathLike[str]
Update = LowRankUpdate | DeltaUpdate


#: Keys of weights this module does not fuse, and why.
_UNSUPPORTED = (
    (
        ("lora_te_", "lora_te1_", "lora_te2_", "text_encoder.", "text_encoder_2.", "text_encoders."),
        "a text-encoder LoRA weight; only the transformer's are fused",
    ),
    ((".dora_scale", ".lora_magnitude_vector"), "a DoRA magnitude; only plain LoRA is fused"),
    ((".lokr_w1", ".lokr_w2", ".hada_w1_a", ".hada_w2_a"), "a LoKr/LoHa factor, not a LoRA"),
)


@dataclasses.dataclass(frozen=True)
class LoraFile:
    """A LoRA file read for one model: its layout and the updates of the model's parameters."""

    path: Path
    family: str
    layout: str
    updates: tuple[Update, ...]

    @property
    def targets(self) -> list[str]:
        """The jaxdit parameters it updates (dotted paths, stacked ones without a layer index)."""
        return sorted({u.target for u in self.updates})

    @property
    def nbytes(self) -> int:
        """Host bytes of the fp32 updates."""
        return sum(
            u.a.nbytes + u.b.nbytes if isinstance(u, LowRankUpdate) else u.delta.nbytes for u in self.updates
        )

    def __repr__(self) -> str:
        return f"LoraFile({str(self.path)!r}, {self.family} {self.layout}, {len(self.updates)} updates)"


@functools.lru_cache(maxsize=16)
def _layouts(family: str, config: Any) -> tuple[LoraLayout, ...]:
    """A config's layouts (key tables and their indexes), built once per config."""
    return tuple(LORA_FAMILIES[family].layouts(config))


@functools.lru_cache(maxsize=16)
def _shapes(family: str, config: Any) -> Mapping[str, tuple[int, ...]]:
    return LORA_FAMILIES[family].parameter_shapes(config)


def family_of(config: Any) -> str:
    """The name of the family whose LoRA layouts read a model of this config ("flux", "wan", ...)."""
    for name, fam in LORA_FAMILIES.items():
        if isinstance(config, fam.config_type):
            return name
    raise TypeError(
        f"no LoRA layouts for a {type(config).__name__}; registered: {', '.join(LORA_FAMILIES) or 'none'} "
        "(a family's layouts register when jaxdit.families is imported)"
    )


def _open(path: Path) -> SafetensorsFile:
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            raise LoraError(
                f"{path}: a LoRA folder must hold exactly one .safetensors file, found {len(files)}"
            )
        path = files[0]
    if not path.exists():
        raise LoraError(f"{path}: no such file")
    if path.suffix.lower() in (".pt", ".pth", ".bin", ".ckpt", ".pkl"):
        raise LoraError(f"{path}: pickle-based files are not read (unsafe); convert the LoRA to .safetensors")
    return SafetensorsFile(path)


def _reject_unsupported(keys: list[str], path: Path) -> None:
    for patterns, why in _UNSUPPORTED:
        for key in keys:
            if any(key.startswith(p) or p in key for p in patterns):
                raise LoraError(f"{path}: key {key!r} is {why}")


def _list(keys: list[str], n: int = 3) -> str:
    return ", ".join(repr(k) for k in keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _detect(family: str, config: Any, keys: list[str], path: Path) -> tuple[LoraLayout, dict]:
    """The layout that reads every key; otherwise an error naming the keys no layout reads."""
    best: tuple[int, LoraLayout, list[str]] | None = None
    for layout in _layouts(family, config):
        modules, unknown = parse_keys(layout, keys)
        if not unknown:
            return layout, modules
        read = len(keys) - len(unknown)
        if best is None or read > best[0]:
            best = (read, layout, unknown)
    assert best is not None
    read, layout, unknown = best
    if read == 0:
        others = [name for name, fam in LORA_FAMILIES.items() if name != family and fam.looks_like(keys)]
        if others:
            raise LoraError(
                f"{path}: a LoRA for {others[0].upper()} (keys like {keys[0]!r}), but the model is "
                f"{family.upper()}"
            )
        names = ", ".join(lay.name for lay in _layouts(family, config))
        raise LoraError(
            f"{path}: unknown LoRA layout: no {family.upper()} layout ({names}) reads its keys "
            f"(e.g. {_list(keys)})"
        )
    raise LoraError(
        f"{path}: key {unknown[0]!r} matches no parameter of this {family.upper()} model "
        f"({LORA_FAMILIES[family].describe(config)}) in the {layout.name} layout that its other {read} keys use "
        f"({len(unknown)} such keys: {_list(unknown)}); a LoRA for another model size or variant?"
    )


def read_lora(path: PathLike, config: Any, *, component: str = "transformer") -> LoraFile:
    """Read a LoRA file for the model of ``config`` (a ``FluxConfig`` or ``WanConfig``).

    ``path``: a ``.safetensors`` file, or a folder holding exactly one (diffusers' ``save_lora_weights``).
    ``component``: the pipeline component whose entries of diffusers' metadata apply (``transformer``).
    Detects the layout, checks every key, rank, shape and value, and returns the parameter updates in
    fp32 with the layout's alpha / rank applied (the user's scale is applied when fusing).
    """
    path = Path(path)
    family = family_of(config)
    with _open(path) as file:
        keys = list(file.keys())
        if not keys:
            raise LoraError(f"{file.path}: the file holds no tensors")
        _reject_unsupported(keys, file.path)
        layout, modules = _detect(family, config, keys, file.path)
        peft = peft_metadata(file.metadata, str(file.path), component) if layout.alpha == "peft" else None
        updates = convert_modules(layout, modules, file, file.path, _shapes(family, config), peft)
    return LoraFile(file.path, family, layout.name, tuple(updates))
