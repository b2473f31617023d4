"""A parameter's logical axis names, as its module declared them (``logical_axes`` metadata)."""

from __future__ import annotations

from typing import Any

__all__ = ["logical_axes"]


def logical_axes(variable: Any) -> tuple[str | None, ...]:
    """A parameter's logical names; stacked (scanned) blocks gain a leading "layers" axis.

    ``variable`` is an ``nnx.Variable`` (concrete or abstract); only its metadata and shape are read, so
    the rule tables' layer needs no model code."""
    axes = tuple(variable.get_metadata().get("logical_axes", ()))
    ndim = len(variable.shape) if hasattr(variable, "shape") else variable[...].ndim
    if ndim == len(axes) + 1:
        axes = ("layers",) + axes
    if ndim != len(axes):
        raise ValueError(f"parameter of shape {variable.shape} declares logical axes {axes}")
    return axes
