"""Qwen-Image as a jaxdit model family (see ``jaxdit.families.base``).

Ties ``models/qwen_image.py`` (the transformer), ``converters/qwen_image.py`` (diffusers and ComfyUI
checkpoints), ``pipelines/qwen_image.py`` (the text-to-image pipeline) and ``pipelines/pipefusion/
qwen_image.py`` (its stage layout) together, and adds the diffusers call surface of the forward
(:class:`QwenImageForward`), the presets (the model card's aspect sizes), the ``jaxdit generate`` checks
and the cost terms ``jaxdit plan`` prices.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from converters import qwen_image as qwen_converters
from converters.lora import qwen_image as qwen_lora
from jaxdit.cache.hooks import ALL_CACHES
from jaxdit.families.base import ModelFamily, Preset, Reduction, StepTerms
from jaxdit.families.forward import as_float, expect_shape, per_batch
from jaxdit.loading.qwen_image_encoder import check_text_encoder_folder
from jaxdit.models import qwen_image
from jaxdit.models.qwen_image import TIME_FREQ_DIM
from jaxdit.models.qwen_image_config import QwenImageConfig
from jaxdit.parallel.pipefusion import validate_pipefusion
from jaxdit.pipelines.model_folder import ModelFolder, read_json
from jaxdit.pipelines.pipefusion.flux import validate_patches
from jaxdit.pipelines.pipefusion.qwen_image import PipeFusionQwenImage, default_num_patches
from jaxdit.pipelines.qwen_image import FOLDER_CLASSES, QwenImagePipeline
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.text_encoders.qwen_image_prompt import MAX_PROMPT_TOKENS

__all__ = ["QWEN_IMAGE", "QwenImageFamily", "QwenImageForward"]

#: VAE spatial compression x the 2x2 token patches.
PIXELS_PER_TOKEN = 16
#: Text tokens ``jaxdit plan`` prices when a run gives none: the most a prompt keeps (an upper bound;
#: prompts keep their own lengths).
PLAN_TEXT_TOKENS = MAX_PROMPT_TOKENS


def _preset(height: int, width: int) -> Preset:
    return Preset(steps=50, height=height, width=width, branches=2, kind="qwen-image")


class QwenImageForward:
    """A Qwen-Image transformer on a mesh, called like diffusers' ``QwenImageTransformer2DModel.forward``
    with the RoPE ids given instead of ``img_shapes`` (``models.qwen_image_config.rope_positions``).

    ``hidden_states`` [B, N, in_channels] packed latents, ``encoder_hidden_states`` [B, T, text width],
    ``timestep`` [B] (or a scalar) sigma in [0, 1], ``img_ids`` [N, 3], ``txt_ids`` [T, 3],
    ``encoder_hidden_states_mask`` [B, T] (1 = real token; None: all real); the edit models' input
    pictures: ``reference_hidden_states`` [B, R, in_channels] and ``reference_ids`` [R, 3]
    (``edit_rope_positions``; diffusers joins them to ``hidden_states``). Returns [B, N, 4 x
    out_channels] (the denoised tokens only) as a jax array in the model's dtype.
    """

    def __init__(self, model: nnx.Module, mesh: Mesh, **options: Any) -> None:
        self.config, self.mesh, self.dtype = model.config, mesh, model.dtype
        self.forward = qwen_image.sharded(model, mesh, **options)

    @property
    def params(self) -> nnx.State:
        return self.forward.state

    def __call__(
        self,
        hidden_states: Any,
        encoder_hidden_states: Any,
        timestep: Any,
        img_ids: Any,
        txt_ids: Any,
        encoder_hidden_states_mask: Any = None,
        reference_hidden_states: Any = None,
        reference_ids: Any = None,
    ) -> jax.Array:
        c, sizes = self.config, {}
        expect_shape("hidden_states", hidden_states, ("B", "N", c.in_channels), sizes)
        expect_shape("encoder_hidden_states", encoder_hidden_states, ("B", "T", c.joint_attention_dim), sizes)
        expect_shape("img_ids", img_ids, ("N", 3), sizes)
        expect_shape("txt_ids", txt_ids, ("T", 3), sizes)
        inputs = dict(
            hidden_states=as_float(hidden_states, self.dtype),
            encoder_hidden_states=as_float(encoder_hidden_states, self.dtype),
            timestep=per_batch(timestep, sizes["B"], "timestep"),
            img_ids=as_float(img_ids, jnp.float32),
            txt_ids=as_float(txt_ids, jnp.float32),
        )
        if encoder_hidden_states_mask is not None:
            expect_shape("encoder_hidden_states_mask", encoder_hidden_states_mask, ("B", "T"), sizes)
            inputs["encoder_hidden_states_mask"] = np.asarray(encoder_hidden_states_mask).astype(bool)
        if (reference_hidden_states is None) != (reference_ids is None):
            raise ValueError("pass reference_hidden_states [B, R, C] and reference_ids [R, 3] together")
        if reference_hidden_states is not None:  # the edit pipelines' clean input-picture tokens
            expect_shape("reference_hidden_states", reference_hidden_states, ("B", "R", c.in_channels), sizes)
            expect_shape("reference_ids", reference_ids, ("R", 3), sizes)
            inputs["reference_hidden_states"] = as_float(reference_hidden_states, self.dtype)
            inputs["reference_ids"] = as_float(reference_ids, jnp.float32)
        return self.forward(**inputs)


class QwenImageFamily(ModelFamily):
    name = "qwen-image"
    display = "Qwen-Image"
    checkpoints = qwen_converters.CHECKPOINTS
    lora = qwen_lora.LORA
    # The model card's sizes per aspect ratio (width x height); 4:3 and 3:4 list 1140, which is no
    # multiple of 16: diffusers floors it to 1136 (with a warning), the size these presets draw.
    presets = {
        "qwen-image": _preset(1328, 1328),
        "qwen-image-16x9": _preset(928, 1664),
        "qwen-image-9x16": _preset(1664, 928),
        "qwen-image-4x3": _preset(1136, 1472),
        "qwen-image-3x4": _preset(1472, 1136),
        "qwen-image-3x2": _preset(1056, 1584),
        "qwen-image-2x3": _preset(1584, 1056),
    }
    folder_classes = FOLDER_CLASSES
    pipeline_class = QwenImagePipeline
    staged_model = PipeFusionQwenImage
    caches = ALL_CACHES  # its transformer has every hook of jaxdit.cache.hooks.CacheHooks
    cfg_scale_argument = "true_cfg_scale"
    cfg_needs = (
        "a --negative_prompt (or negative embeddings) and --true_cfg_scale > 1 (Qwen-Image's default 4)"
    )
    default_branches = 2
    embedding_names = (
        "prompt_embeds",
        "prompt_embeds_mask",
        "negative_prompt_embeds",
        "negative_prompt_embeds_mask",
    )
    text_token_limit = (MAX_PROMPT_TOKENS, "the prompt tokens Qwen-Image keeps, as diffusers")
    example_prompt = "a coffee shop entrance with a chalkboard sign reading 'Qwen Coffee'"

    def preset_config(self, name: str) -> QwenImageConfig:
        return QwenImageConfig.preset("qwen-image")  # every aspect size is the one model

    def check_folder(self, folder: ModelFolder) -> None:
        """The text encoder must be Qwen2.5-VL (its template and dropped prefix are made for it): checked
        from its config before anything loads."""
        try:
            check_text_encoder_folder(folder.root)
        except Exception as e:  # CheckpointError: one line naming the folder
            raise ValueError(str(e)) from None

    def bare_pipeline(self, model: Any, mesh: Mesh, **options: Any) -> QwenImagePipeline:
        return QwenImagePipeline(model, mesh, **options)

    def wrap(self, model: nnx.Module, mesh: Mesh, **options: Any) -> QwenImageForward:
        return QwenImageForward(model, mesh, **options)

    def example_request(self, w: Any) -> GenerationRequest:
        m, (text, _), rows = w.model, w.tokens, w.requests
        embeds = np.zeros((rows, text, m.joint_attention_dim), np.float32)
        mask = np.ones((rows, text), bool)
        cfg = {"true_cfg_scale": 1.0}
        if w.branches == 2:
            cfg = dict(negative_prompt_embeds=embeds, negative_prompt_embeds_mask=mask, true_cfg_scale=4.0)
        height, width, _ = w.size
        return GenerationRequest.of(  # the masks are Qwen-Image's own arguments (family_arguments)
            prompt_embeds=embeds,
            prompt_embeds_mask=mask,
            height=height,
            width=width,
            num_inference_steps=w.steps,
            output_type="latent",
            **cfg,
        )

    # ------------------------------------------------------------------ jaxdit generate
    def size_multiple(self, folder: ModelFolder | None) -> int:
        """The VAE's factor (2 per temporal-downsample entry, as diffusers reads it from vae/config.json; 8
        for Qwen-Image) x the 2x2 token patches."""
        if folder is None:
            return PIXELS_PER_TOKEN
        levels = len(read_json(folder["vae"] / "config.json").get("temperal_downsample", (0,) * 3))
        return 2**levels * 2

    def check_generate(self, request: Any, config: QwenImageConfig | None, parallel: Any) -> None:
        """Enough steps for the folder's terminal stretch; an embeddings file against the model."""
        scheduler = getattr(getattr(request, "folder", None), "scheduler_config", None) or {}
        if scheduler.get("shift_terminal") and request.num_inference_steps < 2:
            raise ValueError(
                f"--steps {request.num_inference_steps}: this scheduler stretches its schedule to end at sigma "
                f"{scheduler['shift_terminal']:g}, which a single step from pure noise cannot (diffusers gives "
                "NaN there); use 2 or more steps"
            )
        shapes = getattr(request, "embeddings", None)
        if config is None or shapes is None:
            return
        if "prompt_embeds" not in shapes:
            raise ValueError(
                "the embeddings file has no prompt_embeds (Qwen-Image needs [B, T, C] and its mask)"
            )
        for key in ("prompt_embeds", "negative_prompt_embeds"):
            got = shapes.get(key)
            if got is not None and (len(got) != 3 or got[-1] != config.joint_attention_dim):
                raise ValueError(
                    f"{key} has shape {tuple(got)}; this model takes [B, T, {config.joint_attention_dim}]"
                )

    def guidance_scale_ignored(self, config: QwenImageConfig, label: str) -> str | None:
        """Qwen-Image embeds no guidance scale (diffusers ignores ``guidance_scale`` with a warning)."""
        return (
            f"--guidance_scale: Qwen-Image ({label}) embeds no guidance scale, so it would change nothing; "
            "its classifier-free guidance is --true_cfg_scale with --negative_prompt"
        )

    def check_pipefusion(self, request: Any, config: QwenImageConfig, parallel: Any, multiple: int) -> None:
        """M >= P patches of whole rows of packed tokens that ring x ulysses splits; 1 <= warm-up <= steps."""
        rows, cols = request.height // multiple, request.width // multiple
        patches = request.num_pipeline_patch
        if patches is None:
            patches = default_num_patches(parallel.pipefusion, rows)
        warmup = 1 if request.warmup_steps is None else request.warmup_steps
        validate_pipefusion(parallel.pipefusion, patches, warmup, request.num_inference_steps)
        validate_patches(rows, cols, patches, parallel.sequence_degree)

    # ------------------------------------------------------------------ jaxdit plan
    def workload_shape(self, config, height, width, frames, text_tokens):
        if frames != 1:
            raise ValueError(f"Qwen-Image makes images: frames must be 1, got {frames}")
        image = (height // PIXELS_PER_TOKEN) * (width // PIXELS_PER_TOKEN)
        return (PLAN_TEXT_TOKENS if text_tokens is None else text_tokens, image), ()

    def output_features(self, config: QwenImageConfig) -> int:
        return config.output_features

    def step_terms(self, w: Any, parallel: Any, sh: Any) -> StepTerms:
        """Qwen-Image's blocks (``models/qwen_image_blocks.py``): each dual-stream block runs two 6E AdaLN
        modulations (replicated), q/k/v + out projections and a 4E MLP on both streams (column- then
        row-parallel, one all-reduce after each row-parallel projection per stream). The timestep embedder,
        the input projections and the output layer are replicated."""
        m, e, b = w.model, w.hidden, sh.b
        n_txt, n_img = sh.local
        e_t, f_t, d = sh.e_t, sh.f_t, w.head_dim
        nonblock = (
            2 * b * (TIME_FREQ_DIM * e + e * e)  # timestep embedder
            + 2 * b * n_img * m.in_channels * e  # img_in
            + 2 * b * n_txt * m.joint_attention_dim * e  # txt_in
            + 2 * b * e * 2 * e  # output AdaLN
            + 2 * b * n_img * e * m.output_features  # proj_out
        )
        block = (
            2 * (2 * b * e * 6 * e)  # img_mod, txt_mod
            + 2 * b * sh.n * e * e_t * 4  # q, k, v, out on both streams
            + 2 * b * sh.n * e * f_t * 2  # MLP in and out
            + sh.self_attention_flops
        )
        param_nonblock = (
            (TIME_FREQ_DIM * e + e)
            + (e * e + e)
            + m.joint_attention_dim  # txt_norm
            + (m.in_channels * e + e)
            + (m.joint_attention_dim * e + e)
            + (e * 2 * e + 2 * e)
            + (e * m.output_features + m.output_features)
        )
        stream = 3 * (e * e_t + e_t) + (e_t * e + e) + (e * f_t + f_t) + (f_t * e + e) + (e * 6 * e + 6 * e)
        a = w.itemsize
        reductions = (
            Reduction("text stream: to_add_out and MLP-down partial sums", 0, 2, b * n_txt * e),
            Reduction("image stream: to_out and MLP-down partial sums", 0, 2, b * n_img * e),
        )
        return StepTerms(
            nonblock_flops=nonblock,
            block_flops=(block,),
            attention_flops=sh.self_attention_flops,
            param_nonblock_bytes=param_nonblock * a,
            param_block_bytes=((2 * stream + 4 * d) * a,),
            reductions=reductions,
            masked_keys=True,
        )


QWEN_IMAGE = QwenImageFamily()
