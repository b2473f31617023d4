"""Text and image encoders (T5 / umT5, CLIP text and vision) in Flax NNX, with prompt encoders mirroring
diffusers' FLUX and Wan pipelines. Each runs on one device of its own; see ``encoders.py``
(``jaxdit.loading.encoders`` loads them from a model folder). The decoder-LM encoder (Qwen2.5-VL text,
Qwen3, Mistral; ``decoder_lm.py``) runs on one device or sharded over a mesh
(``jaxdit.loading.decoder_lm``)."""

from jaxdit.text_encoders.clip import CLIPTextConfig, CLIPTextModel, CLIPVisionConfig, CLIPVisionModel
from jaxdit.text_encoders.decoder_lm import DecoderLM, DecoderLMRunner
from jaxdit.text_encoders.decoder_lm_config import DecoderLMConfig
from jaxdit.text_encoders.encoders import FluxTextEncoders, WanImageEncoder, WanTextEncoder, prompt_clean
from jaxdit.text_encoders.t5 import T5Config, T5Encoder

__all__ = [
    "CLIPTextConfig",
    "CLIPTextModel",
    "CLIPVisionConfig",
    "CLIPVisionModel",
    "DecoderLM",
    "DecoderLMConfig",
    "DecoderLMRunner",
    "FluxTextEncoders",
    "T5Config",
    "T5Encoder",
    "WanImageEncoder",
    "WanTextEncoder",
    "prompt_clean",
]
