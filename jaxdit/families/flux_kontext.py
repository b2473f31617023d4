"""FLUX.1 Kontext [dev] as a jaxdit model family: FLUX.1's transformer, converters, LoRA layouts and cost
terms, with its own pipeline (``pipelines/flux_kontext.py``: a reference image joined along the
sequence) and folder class.

Kontext's transformer has FLUX.1-dev's shapes and config class, so a checkpoint alone cannot say which
it is: a diffusers folder says so in ``model_index.json`` (``_class_name: FluxKontextPipeline``), and a
bare BFL / ComfyUI / diffusers transformer file is run as Kontext by passing it to
``FluxKontextPipeline.from_pretrained(folder, transformer=...)`` or naming ``--model flux-kontext-dev``.
"""

from __future__ import annotations

from typing import Any

from jaxdit.families.base import Preset
from jaxdit.families.flux import PIXELS_PER_TOKEN, FluxFamily
from jaxdit.models import flux
from jaxdit.pipelines import flux_kontext as kontext
from jaxdit.pipelines.model_folder import ModelFolder

__all__ = ["FLUX_KONTEXT", "FluxKontextFamily"]


class FluxKontextFamily(FluxFamily):
    name = "flux-kontext"
    display = "FLUX.1 Kontext"
    variant_of = (
        "flux"  # FLUX.1-dev's shapes: found by its folder (model_index.json) or preset, never by shape
    )
    presets = {"flux-kontext-dev": Preset(steps=28, height=1024, width=1024, kind="flux-kontext")}
    folder_classes = kontext.FOLDER_CLASSES
    pipeline_class = kontext.FluxKontextPipeline

    def preset_config(self, name: str) -> flux.FluxConfig:
        return flux.FluxConfig.preset("flux-dev")  # Kontext [dev] has FLUX.1-dev's shapes

    def image_input(self, folder: ModelFolder) -> str:
        return "optional"  # without a picture Kontext generates from the prompt alone, as diffusers

    def _size(self, request: Any, multiple: int) -> tuple[int, int]:
        area = request.family_arguments.get("max_area")
        area = kontext.MAX_AREA if area is None else area
        if area < 1:
            raise ValueError(f"--max_area must be a positive number of pixels, got {area}")
        return kontext.output_size(request.height, request.width, area, multiple)

    def check_generate(self, request: Any, config: Any, parallel: Any) -> None:
        """The output size after ``max_area``, and the reference picture (read from its header only)
        against the VAE factor, before any weight loads."""
        super().check_generate(request, config, parallel)
        folder = request.folder
        multiple = self.size_multiple(folder)
        h, w = self._size(request, multiple)
        if min(h, w) < multiple:
            raise ValueError(
                f"--max_area {request.family_arguments.get('max_area')} leaves no "
                f"{request.height}x{request.width} picture"
            )
        path = getattr(getattr(request, "request", None), "image", None)
        if path is not None:
            from PIL import Image

            with Image.open(path) as picture:
                width, height = picture.size
            auto = request.family_arguments.get("auto_resize")
            auto = True if auto is None else auto
            try:
                kontext.reference_size(height, width, multiple // 2, auto)
            except ValueError as e:
                raise ValueError(f"--image {path}: {e}") from None

    def workload_shape(self, config, height, width, frames, text_tokens):
        """FLUX.1's groups with the image stream grown by a reference picture of the output's aspect at
        its preferred resolution (what an edit reads by default); the reference's tokens run through the
        image stream's weights, so they are priced as image-stream tokens."""
        (text, image), context = super().workload_shape(config, height, width, frames, text_tokens)
        h, w = kontext.reference_size(height, width, PIXELS_PER_TOKEN // 2)
        return (text, image + (h // PIXELS_PER_TOKEN) * (w // PIXELS_PER_TOKEN)), context

    def check_pipefusion(self, request: Any, config: Any, parallel: Any, multiple: int) -> None:
        h, w = self._size(request, multiple)
        super().check_pipefusion(_Sized(request, h, w), config, parallel, multiple)


class _Sized:
    """A request view with the size Kontext generates at (after ``max_area``)."""

    def __init__(self, request: Any, height: int, width: int) -> None:
        self._request, self.height, self.width = request, height, width

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


FLUX_KONTEXT = FluxKontextFamily()
