"""Qwen-Image-Edit (and Edit-2509, diffusers' ``QwenImageEditPlusPipeline``) as a jaxdit model family:
Qwen-Image's transformer, converters, LoRA layouts and cost terms, with its own pipeline
(``pipelines/qwen_image_edit.py``: the input pictures read by Qwen2.5-VL's vision tower and joined to the
noise as reference tokens) and folder classes.

The edit transformer has Qwen-Image's shapes, so a checkpoint alone cannot say which it is: a diffusers
folder says so in ``model_index.json``; Edit-2511 is a Plus folder whose transformer sets
``zero_cond_t``. PipeFusion carries the reference tokens as a never-denoised token group
(``pipelines/pipefusion/qwen_image.py``); ``jaxdit plan`` does not price that layout yet.
"""

from __future__ import annotations

from typing import Any

from jaxdit.families.base import Preset
from jaxdit.families.qwen_image import QwenImageFamily
from jaxdit.pipelines import qwen_image_edit as edit
from jaxdit.pipelines.model_folder import ModelFolder

__all__ = ["QWEN_IMAGE_EDIT", "QwenImageEditFamily"]


class QwenImageEditFamily(QwenImageFamily):
    name = "qwen-image-edit"
    display = "Qwen-Image-Edit"
    variant_of = "qwen-image"  # Qwen-Image's shapes: found by its folder (model_index.json), never by shape
    presets = {
        "qwen-image-edit": Preset(steps=50, height=1024, width=1024, branches=2, kind="qwen-image-edit")
    }
    folder_classes = edit.FOLDER_CLASSES
    pipeline_class = edit.QwenImageEditPipeline

    def image_input(self, folder: ModelFolder) -> str:
        return "several" if folder.kind == "qwen-image-edit-plus" else "required"

    def image_count(self, folder: ModelFolder) -> tuple[int, int | None]:
        return (1, None) if folder.kind == "qwen-image-edit-plus" else (1, 1)  # always a picture to edit

    def picture_problem(self, folder: ModelFolder, width: int, height: int) -> str | None:
        return edit.picture_problem(width, height, plus=folder.kind == "qwen-image-edit-plus")

    def check_generate(self, request: Any, config: Any, parallel: Any) -> None:
        """An input picture (or several, for Plus), before any weight loads."""
        super().check_generate(request, config, parallel)
        image = getattr(getattr(request, "request", None), "image", None)
        if image is None:
            raise ValueError("Qwen-Image-Edit edits a picture: pass --image IN.png (repeat it for several)")
        folder = getattr(request, "folder", None)
        if (
            isinstance(image, tuple)
            and len(image) > 1
            and folder is not None
            and folder.kind == "qwen-image-edit"
        ):
            raise ValueError(
                f"Qwen-Image-Edit reads one input picture, got {len(image)} (Qwen-Image-Edit-2509's "
                "QwenImageEditPlusPipeline reads several)"
            )

    def pipefusion_unsupported(self, workload: Any) -> str | None:
        # The plan's example request has no pictures, so it would price text-to-image's layout.
        return "jaxdit plan prices no Qwen-Image-Edit PipeFusion layout with reference pictures yet"

    def workload_shape(self, config, height, width, frames, text_tokens):
        """Qwen-Image's groups with the image stream grown by one input picture of the output's size
        (the reference tokens run through the image stream's weights)."""
        (text, image), context = super().workload_shape(config, height, width, frames, text_tokens)
        return (text, 2 * image), context


QWEN_IMAGE_EDIT = QwenImageEditFamily()
