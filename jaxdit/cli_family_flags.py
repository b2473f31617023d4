"""``jaxdit generate``'s flags for the call arguments families declare themselves
(``jaxdit.pipelines.call_options``): parsed after the shared flags, from what those left over, and listed
by ``--help``, both from the family registry.

The shared flags parse without importing jax or a family; only a run that has left-over arguments (or
asks for ``--help``) reads the registry. A family flag must not be a prefix of a shared flag's name
(argparse would take it for that flag's abbreviation).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["FamilyHelp", "add_family_flags", "parse_family_flags"]


def add_family_flags(parser: argparse.ArgumentParser) -> None:
    """Add every registered family's own flags to ``parser``, in a group of their own."""
    from jaxdit import families
    from jaxdit.pipelines.call_options import add_flag

    declared = families.call_options()
    if not declared:
        return
    group = parser.add_argument_group("options of one model family (its pipeline's own call arguments)")
    for option, owners in declared.values():
        add_flag(group, option, " / ".join(f.display for f in owners))


def parse_family_flags(extras: Sequence[str], error: Callable[[str], Any]) -> tuple[tuple[str, Any], ...]:
    """The family flags among the arguments the shared flags left over, as (flag name, value) pairs of
    the flags given; ``error`` (the command's ``parser.error``) reports any argument that is none."""
    parser = argparse.ArgumentParser(prog="jaxdit generate", add_help=False)
    add_family_flags(parser)
    given, rest = parser.parse_known_args(list(extras))
    if rest:
        error(f"unrecognized arguments: {' '.join(rest)}")
    return tuple((name, value) for name, value in vars(given).items() if value is not None)


class FamilyHelp(argparse.Action):
    """``-h/--help`` that lists the registered families' own flags with the shared ones."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None
    ) -> None:
        add_family_flags(parser)
        parser.print_help()
        parser.exit()
