"""A family's own call arguments: keywords its pipeline's ``__call__`` takes beyond the shared
:class:`~jaxdit.pipelines.request.GenerationRequest` fields, each with the ``jaxdit generate`` flag that
sets it.

A pipeline lists them in its ``call_options``; nothing shared names them. In a call they travel in
``GenerationRequest.family_arguments`` (the pipeline reads ``request.family_arguments["max_area"]``), and
``jaxdit generate`` finds their flags through the family registry once the shared flags are parsed (so
that parsing the shared flags imports no family and no jax): a flag no registered family declares is an
unrecognised argument, and one the running family does not declare is refused in one line naming the
families that take it. Importing this module imports neither jax nor a family.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["CallOption", "add_flag"]


@dataclasses.dataclass(frozen=True)
class CallOption:
    """One call argument of a family's pipeline and its ``jaxdit generate`` flag.

    ``name``: the ``__call__`` keyword (diffusers' name where diffusers has one). ``help``: what the flag
    does (``--help`` puts the family's name before it). ``flag``: the flag's name when it is not ``name``
    (e.g. ``no_auto_resize`` for ``auto_resize=False``). ``type``: parses the flag's value (argparse's
    ``type``); None makes the flag a switch that, when given, passes ``value``. A flag not given passes
    nothing: the call's own default applies.
    """

    name: str
    help: str
    flag: str | None = None
    type: Callable[[str], Any] | None = None
    value: Any = True
    metavar: str | None = None

    @property
    def flag_name(self) -> str:
        return self.flag or self.name

    def call_value(self, given: Any) -> Any:
        """The call argument for the flag's parsed value."""
        return self.value if self.type is None else given


def add_flag(parser: argparse.ArgumentParser | Any, option: CallOption, owners: str) -> None:
    """Add ``--flag_name`` (and its hyphenated spelling) for ``option``; ``owners`` names the families
    that take it, for the help."""
    name = option.flag_name
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    kwargs: dict[str, Any] = {"dest": name, "default": None, "help": f"{owners}: {option.help}"}
    if option.type is None:
        kwargs.update(action="store_const", const=True)
    else:
        kwargs.update(type=option.type, metavar=option.metavar)
    parser.add_argument(*spellings, **kwargs)
