"""FLUX.2 [dev] / [klein] as a jaxdit model family (see ``jaxdit.families.base``): its transformer
(``models/flux2.py``, ``converters/flux2.py``) with presets and the cost terms ``jaxdit plan`` prices, and
the klein pipeline (``pipelines/flux2.py``: Qwen3 encoder, multi-reference editing; distilled without CFG,
base with it). FLUX.2 [dev]'s pipeline (Mistral Small 3.1 encoder, embedded guidance) is the variant
family of ``families/flux2_dev.py``, found by its folder; a dev transformer checkpoint alone (a diffusers
``transformer/`` folder or BFL's single file, with ``--prompt_embeds``) runs here through dev's pipeline
(:meth:`Flux2Family.checkpoint_pipeline`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import Mesh

from converters import flux2 as flux2_converters
from converters.lora import flux2 as flux2_lora
from jaxdit.cache.hooks import ALL_CACHES
from jaxdit.families.base import ModelFamily, Preset, Reduction, StepTerms, check_calibrated_caches
from jaxdit.models import flux2
from jaxdit.models.flux2_config import Flux2Config
from jaxdit.parallel.pipefusion import validate_pipefusion
from jaxdit.pipelines import flux2_references
from jaxdit.pipelines.flux2 import FOLDER_CLASSES, Flux2KleinPipeline
from jaxdit.pipelines.flux2_dev import DISTILLED, Flux2Pipeline
from jaxdit.pipelines.model_folder import ModelFolder, read_json
from jaxdit.pipelines.pipefusion.flux import default_num_patches, validate_patches
from jaxdit.pipelines.pipefusion.flux2 import PipeFusionFlux2
from jaxdit.pipelines.request import GenerationRequest

__all__ = ["FLUX2", "Flux2Family"]

#: Text tokens the pipelines pad the prompt to (diffusers' ``max_sequence_length`` default, both
#: ``Flux2Pipeline`` and ``Flux2KleinPipeline``).
TEXT_LEN = 512
#: The VAE's 8x spatial compression x the 2x2 patches the pipelines fold into channels.
PIXELS_PER_TOKEN = 16


class Flux2Family(ModelFamily):
    name = "flux2"
    display = "FLUX.2"
    # Its transformer has every hook of jaxdit.cache.hooks.CacheHooks (models/flux2_cache_hooks.py); TeaCache
    # and MagCache take their numbers from the caller (none are published for FLUX.2).
    caches = ALL_CACHES
    checkpoints = flux2_converters.CHECKPOINTS
    lora = flux2_lora.LORA
    presets = {
        # The published defaults: 50 steps for dev (embedded guidance, no CFG), 4 for the distilled klein.
        "flux2-dev": Preset(steps=50, height=1024, width=1024),
        "flux2-klein-4b": Preset(steps=4, height=1024, width=1024),
        "flux2-klein-9b": Preset(steps=4, height=1024, width=1024),
    }
    folder_classes = FOLDER_CLASSES
    pipeline_class = Flux2KleinPipeline
    staged_model = PipeFusionFlux2
    cfg_note = "FLUX.2-dev's guidance is an embedded input and distilled klein runs without CFG"
    cfg_scale_argument = "guidance_scale"
    cfg_needs = "a klein base model (not distilled) with --guidance_scale > 1"
    embedding_names = ("prompt_embeds", "negative_prompt_embeds")

    def bare_pipeline(self, model: Any, mesh: Mesh, **options: Any) -> Any:
        """The pipeline the transformer's guidance embedding calls for: ``jaxdit plan``'s ``flux2-dev``
        preset is this family's, and only dev's pipeline prepares the guidance input."""
        if model.config.guidance_embeds:
            return Flux2Pipeline(model, mesh, **options)
        return Flux2KleinPipeline(model, mesh, **options)

    def check_folder(self, folder: ModelFolder) -> None:
        """The folder's transformer against its pipeline class (dev's embeds a guidance scale, klein's
        does not), from its config.json before any weight is read."""
        config = read_json(folder["transformer"] / "config.json")
        if bool(config.get("guidance_embeds", True)) != self.pipeline_class.embeds_guidance:
            raise ValueError(f"{folder.root.name}: {self.pipeline_class.wrong_transformer}")

    def image_input(self, folder: ModelFolder) -> str:
        return "several"  # text-to-image, or editing with one or more reference pictures

    def picture_problem(self, folder: ModelFolder, width: int, height: int) -> str | None:
        return flux2_references.picture_problem(width, height)

    def example_request(self, w: Any) -> Any:
        m, (text, _), rows = w.model, w.tokens, w.requests
        embeds = np.zeros((rows, text, m.joint_attention_dim), np.float32)
        height, width, _ = w.size
        cfg = dict(negative_prompt_embeds=embeds) if w.branches == 2 else {}
        return GenerationRequest(
            prompt_embeds=embeds,
            height=height,
            width=width,
            num_inference_steps=w.steps,
            output_type="latent",
            guidance_scale=4.0 if cfg else 1.0,
            **cfg,
        )

    def check_generate(self, request: Any, config: Any, parallel: Any) -> None:
        """A distilled klein folder runs one branch whatever --guidance_scale says, so --use_cfg_parallel
        would have nothing to split; a dev transformer checkpoint alone (a guidance embedding: its folder
        is ``families/flux2_dev.py``'s) runs dev's pipeline, guidance-distilled, so it takes neither
        --use_cfg_parallel nor negative embeddings; TeaCache and MagCache come with a calibration's file."""
        check_calibrated_caches(request, self.display)
        if config is not None and config.guidance_embeds:
            given = {
                "--use_cfg_parallel": parallel.cfg == 2,
                "negative_prompt_embeds in --prompt_embeds": "negative_prompt_embeds"
                in (getattr(request, "embeddings", None) or {}),
            }
            flags = [flag for flag, on in given.items() if on]
            if flags:
                raise ValueError(f"{' / '.join(flags)}: {DISTILLED}")
        folder = getattr(request, "folder", None)
        if folder is not None and folder.kind == "flux2-klein" and parallel.cfg == 2:
            raise ValueError(
                f"--use_cfg_parallel needs classifier-free guidance: {folder.root.name} is a distilled "
                "FLUX.2 klein, which runs without it (use a klein base model)"
            )

    def uses_cfg(
        self,
        call: Any,
        folder: ModelFolder | None = None,
        config: Any = None,
        negative_embeds: bool = False,
    ) -> bool:
        """A distilled klein folder (``is_distilled``; dev's always) and a dev transformer (a guidance
        embedding) run one branch whatever the scale, as their pipelines do; else CFG above 1."""
        if folder is not None and self.pipeline_class.one_branch(folder.index):
            return False
        if config is not None and config.guidance_embeds:
            return False
        return super().uses_cfg(call, folder, config, negative_embeds)

    def checkpoint_pipeline(self, config: Any) -> type:
        """Dev's pipeline (the guidance input) for a transformer with a guidance embedding, else klein's."""
        return Flux2Pipeline if config is not None and config.guidance_embeds else Flux2KleinPipeline

    def check_pipefusion(self, request: Any, config: Any, parallel: Any, multiple: int) -> None:
        """M >= P patches of whole rows of packed tokens that ring x ulysses splits, 1 <= warm-up <=
        steps (FLUX.1's rules); reference tokens are chunked over the patches like the text."""
        rows, cols = request.height // multiple, request.width // multiple
        patches = request.num_pipeline_patch
        if patches is None:
            patches = default_num_patches(parallel.pipefusion, rows)
        warmup = 1 if request.warmup_steps is None else request.warmup_steps
        validate_pipefusion(parallel.pipefusion, patches, warmup, request.num_inference_steps)
        validate_patches(rows, cols, patches, parallel.sequence_degree)

    def size_multiple(self, folder: ModelFolder | None) -> int:
        """The VAE's factor (2 per level after the first: 8 for FLUX.2's) x the 2x2 patches."""
        if folder is None:
            return PIXELS_PER_TOKEN
        levels = len(read_json(folder["vae"] / "config.json").get("block_out_channels", (0,) * 4))
        return 2 ** (levels - 1) * 2

    def wrap(self, model: Any, mesh: Mesh, **options: Any) -> Any:
        """diffusers-named keyword arguments (``models/flux2.py``'s ``FORWARD_INPUTS``) on global arrays."""
        return flux2.sharded(model, mesh, **options)

    def output_features(self, config: Flux2Config) -> int:
        return config.output_features

    def workload_shape(self, config, height, width, frames, text_tokens):
        if frames != 1:
            raise ValueError(f"FLUX.2 makes images: frames must be 1, got {frames}")
        image = (height // PIXELS_PER_TOKEN) * (width // PIXELS_PER_TOKEN)
        return (TEXT_LEN if text_tokens is None else text_tokens, image), ()

    def step_terms(self, w: Any, parallel: Any, sh: Any) -> StepTerms:
        """FLUX.2's blocks (``models/flux2_blocks.py``): bias-free; a double block runs q/k/v/out and a
        SwiGLU MLP (gate, value, down) on both streams, a single block q/k/v, the MLP's gate and value
        and one output projection whose [attention | MLP] partial sums share one all-reduce. The three
        modulations are computed once per step outside the blocks; embedders and the final layer are
        replicated."""
        m, e, d, b, n = w.model, w.hidden, w.head_dim, sh.b, sh.n
        n_txt, n_img = sh.local
        c = m.timestep_guidance_channels
        embedders = 1 + int(m.guidance_embeds)
        out = m.output_features
        nonblock = (
            embedders * 2 * b * (c * e + e * e)  # time (+ guidance) embedders
            + 2 * b * e * 15 * e  # the shared modulations: 6E + 6E + 3E
            + 2 * b * n_img * m.in_channels * e  # img_in
            + 2 * b * n_txt * m.joint_attention_dim * e  # txt_in
            + 2 * b * e * 2 * e  # norm_out
            + 2 * b * n_img * e * out  # proj_out
        )
        e_t, f_t = sh.e_t, sh.f_t
        proj = 2 * b * n * e * e_t * 4  # q, k, v, out (both streams of a double block together)
        mlp = 2 * b * n * e * f_t * 3  # gate, value, down
        att = sh.self_attention_flops
        param_nonblock = (
            m.in_channels * e
            + m.joint_attention_dim * e
            + embedders * (c * e + e * e)
            + 15 * e * e
            + 2 * e * e
            + e * out
        )
        qkv = 3 * e * e_t + 2 * d  # column-parallel q/k/v; QK-norm scales replicated
        stream = qkv + e_t * e + 3 * e * f_t
        single = qkv + 2 * e * f_t + e_t * e + f_t * e
        a = w.itemsize
        reductions = (
            Reduction(
                "double blocks, text stream: attention-out and MLP-down partial sums", 0, 2, b * n_txt * e
            ),
            Reduction(
                "double blocks, image stream: attention-out and MLP-down partial sums", 0, 2, b * n_img * e
            ),
            Reduction("single blocks: to_out partial sums ([attention | MLP] in one)", 1, 1, b * n * e),
        )
        return StepTerms(
            nonblock_flops=nonblock,
            block_flops=(proj + mlp + att, proj + mlp + att),
            attention_flops=att,
            param_nonblock_bytes=param_nonblock * a,
            param_block_bytes=(2 * stream * a, single * a),
            reductions=reductions,
        )


FLUX2 = Flux2Family()
