"""Turn logical axis names into PartitionSpecs and NamedShardings through a rule table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec


def logical_to_spec(names: Sequence[str | None], rules: Mapping[str, object]) -> PartitionSpec:
    """("batch", "seq", "act_heads", None) -> P(("data", "cfg"), ("ring", "ulysses"), "tensor", None).

    A mesh axis may be used by one dimension only; a second use is an error naming both.
    """
    used: dict[str, str] = {}
    parts = []
    for name in names:
        target = rules.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        for axis in axes:
            if axis in used:
                raise ValueError(f"mesh axis {axis!r} is mapped from both {used[axis]!r} and {name!r}")
            used[axis] = name
        parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*parts)


def logical_to_sharding(
    names: Sequence[str | None], rules: Mapping[str, object], mesh: Mesh
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules))
