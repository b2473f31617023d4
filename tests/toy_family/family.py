"""The toy family object: ties the toy's model, converter and pipeline together for the registry, and
adds what only it knows (presets, the shape of ``jaxdit generate`` requests, ``jaxdit plan``'s cost
terms). Registered by the tests alone (``tests/test_toy_family.py``'s fixture): one ``register`` call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxdit.families.base import ModelFamily, Preset, Reduction, StepTerms
from jaxdit.pipelines.model_folder import ModelFolder
from jaxdit.pipelines.request import GenerationRequest

from . import model as toy_model
from .converter import CHECKPOINTS
from .pipeline import VAE_FACTOR, ToyPipeline

#: Prompt tokens ``jaxdit plan`` counts when not told (the toy's "text encoder" length).
TEXT_LEN = 8


class ToyFamily(ModelFamily):
    name = "toy"
    caches = frozenset({"fbcache", "dbcache", "taylorseer"})  # its model's one hook: cache_metric_stream
    display = "Toy DiT"
    checkpoints = CHECKPOINTS
    presets = {
        "toy-small": Preset(steps=4, height=8, width=8, kind="toy"),
        "toy-wide": Preset(steps=4, height=16, width=16, kind="toy"),
    }
    folder_classes: dict[str, Any] = {}  # no diffusers pipeline folder: a checkpoint and embeddings
    pipeline_class = ToyPipeline
    staged_model = None  # no PipeFusion stage layout
    cfg_scale_argument = "guidance_scale"
    cfg_needs = "negative_prompt_embeds in --prompt_embeds and --guidance_scale > 1"
    embedding_names = ("prompt_embeds", "negative_prompt_embeds")

    def wrap(self, model: Any, mesh: Mesh, **options: Any) -> Any:
        return toy_model.sharded(model, mesh, **options)

    def size_multiple(self, folder: ModelFolder | None) -> int:
        return VAE_FACTOR

    def workload_shape(self, config, height, width, frames, text_tokens):
        if frames != 1:
            raise ValueError(f"the toy makes images: frames must be 1, got {frames}")
        image = (height // VAE_FACTOR) * (width // VAE_FACTOR)
        return (TEXT_LEN if text_tokens is None else text_tokens, image), ()

    def output_features(self, config: toy_model.ToyConfig) -> int:
        return config.in_channels

    def example_request(self, w: Any) -> GenerationRequest:
        text, _ = w.tokens
        embeds = np.zeros((w.requests, text, w.model.text_dim), np.float32)
        cfg = dict(negative_prompt_embeds=embeds, guidance_scale=2.0) if w.branches == 2 else {}
        height, width, _ = w.size
        return GenerationRequest(
            prompt_embeds=embeds,
            height=height,
            width=width,
            num_inference_steps=w.steps,
            output_type="latent",
            **cfg,
        )

    def step_terms(self, w: Any, parallel: Any, sh: Any) -> StepTerms:
        """The toy's blocks (``model.py``): a replicated 6E modulation, column-parallel q/k/v and MLP-up,
        row-parallel attention-out and MLP-down (two all-reduces a block); embedders and head replicated."""
        m, e, b, n = w.model, w.hidden, sh.b, sh.n
        n_txt, n_img = sh.local
        e_t, f_t, freq = sh.e_t, sh.f_t, toy_model.FREQ_DIM
        embedders = freq * e + e * e + n_img * m.in_channels * e + n_txt * m.text_dim * e
        nonblock = 2 * b * (embedders + e * 2 * e + n_img * e * m.in_channels)  # + the head
        attention_proj = 2 * b * n * e * e_t * 4  # q, k, v, out
        mlp = 2 * b * n * e * f_t * 2
        block = 2 * b * e * 6 * e + attention_proj + mlp + sh.self_attention_flops
        linear = lambda i, o: i * o + o
        params_nonblock = (
            linear(m.in_channels, e) + linear(m.text_dim, e) + linear(freq, e) + linear(e, e)
            + linear(e, 2 * e) + linear(e, m.in_channels)
        )  # fmt: skip
        params_block = linear(e, 6 * e) + 3 * linear(e, e_t) + e_t * e + e + linear(e, f_t) + f_t * e + e
        return StepTerms(
            nonblock_flops=nonblock,
            block_flops=(block,),
            attention_flops=sh.self_attention_flops,
            param_nonblock_bytes=params_nonblock * w.itemsize,
            param_block_bytes=(params_block * w.itemsize,),
            reductions=(Reduction("blocks: attention-out and MLP-down partial sums", 0, 2, b * n * e),),
        )


TOY = ToyFamily()
