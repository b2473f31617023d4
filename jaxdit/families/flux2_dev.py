"""FLUX.2 [dev] as a jaxdit model family: FLUX.2's transformer, converters, presets and cost terms
(``families/flux2.py``) with its own pipeline (``pipelines/flux2_dev.py``: Mistral Small 3.1's prompt
path, the embedded guidance) and folder class (``Flux2Pipeline``).

A variant: a bare FLUX.2 checkpoint belongs to the base family (whose ``flux2-dev`` preset prices dev's
shapes for ``jaxdit plan``); a diffusers folder whose ``model_index.json`` names ``Flux2Pipeline`` runs
here. Dev is guidance-distilled, so the flags of a second branch are refused in one line.
"""

from __future__ import annotations

import math
from typing import Any

from jaxdit.families.base import check_calibrated_caches
from jaxdit.families.flux2 import Flux2Family
from jaxdit.pipelines import flux2_dev

__all__ = ["FLUX2_DEV", "Flux2DevFamily"]


class Flux2DevFamily(Flux2Family):
    name = "flux2-dev"
    display = "FLUX.2 [dev]"
    variant_of = "flux2"  # found by its folder's pipeline class, never by shape
    presets = {}  # ``flux2-dev`` stays the base family's (plan and transformer-only runs)
    folder_classes = flux2_dev.FOLDER_CLASSES
    pipeline_class = flux2_dev.Flux2Pipeline
    cfg_note = "FLUX.2 [dev] is guidance-distilled: its guidance scale is an embedded input"
    cfg_needs = "nothing FLUX.2 [dev] has (it is guidance-distilled)"
    cfg_above = math.inf  # --guidance_scale never turns a second branch on
    guidance_distilled = flux2_dev.DISTILLED
    embedding_names = ("prompt_embeds",)

    def bare_pipeline(self, model: Any, mesh: Any, **options: Any) -> Any:
        return flux2_dev.Flux2Pipeline(model, mesh, **options)

    def check_generate(self, request: Any, config: Any, parallel: Any) -> None:
        """The calibrated caches' files (as klein's); the CFG flags are refused by ``guidance_distilled``,
        and the transformer's guidance embedding is checked by the pipeline when it loads."""
        check_calibrated_caches(request, self.display)


FLUX2_DEV = Flux2DevFamily()
