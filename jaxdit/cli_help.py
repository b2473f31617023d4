"""``--help`` text that names the registered models, looked up only when help is shown.

Parsing flags must not import jax (``jaxdit.families`` does), so a help string carries placeholders that
:class:`RegistryHelp` fills at the moment ``--help`` prints: ``{presets}`` (every preset name, each needing
``--weights``) and ``{bundled}`` (the models shipped inside jaxdit, the first being the default).
"""

from __future__ import annotations

import argparse
import textwrap

__all__ = ["RegistryHelp"]


class RegistryHelp(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        if text and ("{presets}" in text or "{bundled}" in text):
            from jaxdit import families

            text = text.replace("{presets}", ", ".join(families.presets()))
            text = text.replace("{bundled}", " / ".join(families.bundled_names()))
        return text

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Model and preset names hold hyphens (qwen-image-16x9, flux2-klein-4b): wrap between words only,
        # so every name prints whole and can be copied from the help.
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)
