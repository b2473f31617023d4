"""Text and image encoders (T5 / umT5, CLIP text and vision) in Flax NNX, with prompt encoders mirroring
diffusers' FLUX and Wan pipelines. Each runs on one device of its own; see ``encoders.py``
(``jaxdit.loading.encoders`` loads them from a model folder)."""

from jaxdit.text_encoders.clip import CLIPTextConfig, CLIPTextModel, CLIPVisionConfig, CLIPVisionModel
from jaxdit.text_encoders.encoders import FluxTextEncoders, WanImageEncoder, WanTextEncoder, prompt_clean
from jaxdit.text_encoders.t5 import T5Config, T5Encoder

__all__ = [
    "CLIPTextConfig",
    "CLIPTextModel",
    "CLIPVisionConfig",
    "CLIPVisionModel",
    "FluxTextEncoders",
    "T5Config",
    "T5Encoder",
    "WanImageEncoder",
    "WanTextEncoder",
    "prompt_clean",
]
