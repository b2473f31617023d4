"""HunyuanVideo 1.5 image-to-video as a jaxdit model family: the text-to-video family's transformer,
converters and cost terms with its own pipeline (``pipelines/hunyuan_video15_i2v.py``: the first frame's
latents beside the noise, its SigLIP tokens as the image group) and folder class.

The I2V transformer has the T2V one's shapes, so a checkpoint alone cannot say which it is: a diffusers
folder says so in ``model_index.json``. The video's size is the picture's size bucket (diffusers' call
takes none), so ``jaxdit generate`` reads the picture's size before anything loads and refuses a
``--height`` / ``--width`` that differs. ``jaxdit plan`` prices the presets (the released 480p / 720p
I2V configs, a 16:9 picture's bucket, 121 frames) with the 729 SigLIP tokens; ``--verify`` is not here
yet (the example request has no first frame).
"""

from __future__ import annotations

import json
from typing import Any

from jaxdit.families.base import Preset
from jaxdit.families.hunyuan_video15 import HunyuanVideo15Family
from jaxdit.pipelines import hunyuan_video15_i2v as i2v

__all__ = ["HUNYUAN_VIDEO15_I2V", "HunyuanVideo15I2VFamily"]

#: SigLIP so400m-patch14-384's tokens, the image group of the released I2V models (diffusers'
#: ``vision_num_semantic_tokens``).
IMAGE_TOKENS = 729


class HunyuanVideo15I2VFamily(HunyuanVideo15Family):
    name = "hunyuan-video15-i2v"
    display = "HunyuanVideo 1.5 I2V"
    variant_of = "hunyuan-video15"  # the T2V transformer's shapes: found by its folder, never by shape
    presets = {
        "hunyuanvideo1.5-480p-i2v": Preset(
            steps=50, height=480, width=848, frames=121, branches=2, kind="hunyuan-video15-i2v"
        ),
        "hunyuanvideo1.5-720p-i2v": Preset(
            steps=50, height=720, width=1280, frames=121, branches=2, kind="hunyuan-video15-i2v"
        ),
    }
    folder_classes = i2v.FOLDER_CLASSES
    pipeline_class = i2v.HunyuanVideo15ImageToVideoPipeline

    def bare_pipeline(self, model: Any, mesh: Any, **options: Any) -> Any:
        return i2v.HunyuanVideo15ImageToVideoPipeline(model, mesh, **options)

    def generate_defaults(self, request: Any) -> dict[str, Any]:
        """The guider's CFG scale, and the picture's size bucket as the height and width."""
        defaults = super().generate_defaults(request)
        folder, image = request.folder, request.image
        if folder is None or not isinstance(image, str):
            return defaults
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(image) as picture:
                width, height = picture.size
        except (OSError, UnidentifiedImageError):
            return defaults  # the image checks name the problem
        config = json.loads((folder["transformer"] / "config.json").read_text(encoding="utf-8"))
        size = i2v.picture_size((height, width), int(config.get("target_size", 640)))
        return {**defaults, "height": size[0], "width": size[1]}

    def check_generate(self, request: Any, config: Any, parallel: Any) -> None:
        super().check_generate(request, config, parallel)
        r = getattr(request, "request", None)  # jaxdit generate's request behind the call's view
        if r is None:
            return
        if r.image is None:
            raise ValueError(f"{r.weights} is an image-to-video model: give --image (the first frame)")
        bucket = self.generate_defaults(r)
        given = (r.height, r.width)
        if given != (None, None) and "height" in bucket and given != (bucket["height"], bucket["width"]):
            raise ValueError(
                f"HunyuanVideo 1.5 image-to-video draws at the picture's size bucket "
                f"{bucket['height']}x{bucket['width']}; drop --height/--width (got {given[0]}x{given[1]})"
            )

    def workload_shape(self, config, height, width, frames, text_tokens):
        """The text-to-video groups plus the first frame's SigLIP tokens."""
        groups, context = super().workload_shape(config, height, width, frames, text_tokens)
        return (*groups, IMAGE_TOKENS), context


HUNYUAN_VIDEO15_I2V = HunyuanVideo15I2VFamily()
