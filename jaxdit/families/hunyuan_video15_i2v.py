"""HunyuanVideo 1.5 image-to-video as a jaxdit model family: the text-to-video family's transformer,
converters and cost terms with its own pipeline (``pipelines/hunyuan_video15_i2v.py``: the first frame's
latents beside the noise, its SigLIP tokens as the image group) and folder class.

The I2V transformer has the T2V one's shapes, so a checkpoint alone cannot say which it is: a diffusers
folder says so in ``model_index.json``. The video's size is the picture's size bucket (diffusers' call
takes none), so ``jaxdit generate`` reads the picture's size before anything loads and refuses a
``--height`` / ``--width`` that differs. ``jaxdit plan`` prices the presets (the released 480p / 720p
I2V configs, a 16:9 picture's bucket, 121 frames) with the 729 SigLIP tokens; ``--verify`` lowers the
step from a request that carries the first frame's conditioning as zeros of its shapes (the SigLIP
tokens and the condition channels, as the encoders would give them): the step does not depend on the
values, and no encoder is built. ``jaxdit serve`` runs its folders (``serves_image_to_video``): a video
job's ``image`` is the first frame, drawn at its size bucket (``picture_output_size``); pictures beyond
8:1 are refused (``picture_problem``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from jaxdit.families.base import Preset
from jaxdit.families.hunyuan_video15 import SPATIAL, TEMPORAL, HunyuanVideo15Family
from jaxdit.pipelines import hunyuan_video15_i2v as i2v

__all__ = ["HUNYUAN_VIDEO15_I2V", "HunyuanVideo15I2VFamily"]

#: SigLIP so400m-patch14-384's tokens, the image group of the released I2V models (diffusers'
#: ``vision_num_semantic_tokens``).
IMAGE_TOKENS = 729
#: The widest first frame taken (width:height or height:width).
MAX_ASPECT = 8


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
    serves_image_to_video = True  # tests/test_hunyuan_video15_serve.py

    def bare_pipeline(self, model: Any, mesh: Any, **options: Any) -> Any:
        return i2v.HunyuanVideo15ImageToVideoPipeline(model, mesh, **options)

    def example_request(self, w: Any) -> Any:
        """The text-to-video request plus the first frame's conditioning in its shapes: ``image_embeds``
        (the workload's image tokens) and ``condition`` (latent and mask channels over the latent grid)."""
        r = super().example_request(w)
        m, rows = w.model, w.requests
        height, width, frames = w.size
        latent = ((frames - 1) // TEMPORAL + 1, height // SPATIAL, width // SPATIAL)
        return r.replace(
            image_embeds=np.zeros((rows, w.tokens[3], m.image_embed_dim), np.float32),
            condition=np.zeros((rows, m.in_channels - m.out_channels, *latent), np.float32),
        )

    def generate_defaults(self, request: Any) -> dict[str, Any]:
        """The guider's CFG scale, and the picture's size bucket as the height and width (without a
        picture: a 16:9 one's, ``jaxdit serve``'s default size)."""
        defaults = super().generate_defaults(request)
        folder, image = request.folder, request.image
        if folder is None:
            return defaults
        if image is None:  # the 16:9 bucket (a size to start from; a call without a picture is refused)
            width, height = self.picture_output_size(folder, 16, 9)
            return {**defaults, "height": height, "width": width}
        if isinstance(image, np.ndarray):  # a picture already read (jaxdit serve's)
            height, width = image.shape[:2]
        elif isinstance(image, str):
            from PIL import Image, UnidentifiedImageError

            try:
                with Image.open(image) as picture:
                    width, height = picture.size
            except (OSError, UnidentifiedImageError):
                return defaults  # the image checks name the problem
        else:
            return defaults
        width, height = self.picture_output_size(folder, width, height)
        return {**defaults, "height": height, "width": width}

    def picture_output_size(self, folder: Any, width: int, height: int) -> tuple[int, int]:
        """The picture's size bucket at the transformer's ``target_size`` (diffusers' call takes no size)."""
        config = json.loads((folder["transformer"] / "config.json").read_text(encoding="utf-8"))
        size = i2v.picture_size((height, width), int(config.get("target_size", 640)))
        return size[1], size[0]

    def picture_problem(self, folder: Any, width: int, height: int) -> str | None:
        """A picture more than 8:1 (the buckets span 1:4 to 4:1): scaled to cover its bucket, its long
        side would be many times the video's, nearly all of it cut away."""
        if max(width, height) > MAX_ASPECT * min(width, height):
            return f"its aspect ratio is beyond {MAX_ASPECT}:1 (the size buckets span 1:4 to 4:1)"
        return None

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
