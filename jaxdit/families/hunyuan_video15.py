"""HunyuanVideo 1.5 as a jaxdit model family (see ``jaxdit.families.base``).

Ties ``models/hunyuan_video15.py`` (the transformer), ``converters/hunyuan_video15.py`` (diffusers
checkpoints) and ``pipelines/hunyuan_video15.py`` (text-to-video with the Qwen2.5-VL and ByT5 encoders and
the causal VAE) together, and adds the diffusers call surface of the forward
(:class:`HunyuanVideo15Forward`), the presets (480p and 720p at 121 frames, the model card's) and the cost
terms ``jaxdit plan`` prices. Image to video is the variant family ``families/hunyuan_video15_i2v.py``;
the feature caches start at the first dual-stream block; LoRA files in diffusers' layout
(``converters/lora/hunyuan_video15.py``); PipeFusion's stage layout and patches in
``pipelines/pipefusion/hunyuan_video15.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from converters import hunyuan_video15 as hv_converters
from converters.lora import hunyuan_video15 as hv_lora
from jaxdit.cache.hooks import ALL_CACHES
from jaxdit.families.base import ModelFamily, Preset, Reduction, StepTerms, check_calibrated_caches
from jaxdit.models import hunyuan_video15 as hv
from jaxdit.models.hunyuan_video15 import TIME_FREQ_DIM
from jaxdit.models.hunyuan_video15_config import GLYPH_HIDDEN, HunyuanVideo15Config
from jaxdit.models.partitioning import logical_axes
from jaxdit.parallel.flops import attention_flops
from jaxdit.parallel.pipefusion import validate_pipefusion
from jaxdit.pipelines.hunyuan_video15 import FOLDER_CLASSES, HunyuanVideo15Pipeline, read_guider
from jaxdit.pipelines.model_folder import ModelFolder
from jaxdit.pipelines.pipefusion import hunyuan_video15 as hv_pipefusion
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.text_encoders.hunyuan_video15_prompt import GLYPH_TOKENS, PROMPT_TOKENS

__all__ = ["HUNYUAN_VIDEO15", "HunyuanVideo15Family", "HunyuanVideo15Forward"]

#: The VAE's compression (spatial, temporal).
SPATIAL, TEMPORAL = 16, 4


def _preset(height: int, width: int) -> Preset:
    return Preset(steps=50, height=height, width=width, frames=121, branches=2, kind="hunyuan-video15-t2v")


class HunyuanVideo15Forward:
    """A HunyuanVideo 1.5 transformer on a mesh, called like diffusers'
    ``HunyuanVideo15Transformer3DModel.forward``: ``hidden_states`` [B, in_channels, F, H, W], ``timestep``
    [B] (or a scalar) in [0, 1000], the prompt and glyph features with their masks, ``image_embeds`` [B, I,
    C3] (None or zeros: text-to-video), ``timestep_r`` for MeanFlow models. Returns [B, out_channels, F, H,
    W] (numpy fp32)."""

    def __init__(self, model: nnx.Module, mesh: Mesh, **options: Any) -> None:
        self.config: HunyuanVideo15Config = model.config
        self.mesh = mesh
        self.forward = hv.sharded(model, mesh, **options)

    @property
    def params(self) -> nnx.State:
        return self.forward.state

    def __call__(
        self,
        hidden_states: Any,
        timestep: Any,
        encoder_hidden_states: Any,
        encoder_attention_mask: Any,
        encoder_hidden_states_2: Any,
        encoder_attention_mask_2: Any,
        image_embeds: Any = None,
        timestep_r: Any = None,
    ) -> np.ndarray:
        c = self.config
        x = np.asarray(hidden_states, np.float32)
        inputs = hv.forward_inputs(
            x,
            np.asarray(encoder_hidden_states, np.float32),
            encoder_attention_mask,
            np.asarray(encoder_hidden_states_2, np.float32),
            encoder_attention_mask_2,
            image_embeds,
            c,
        )
        batch = x.shape[0]
        t = np.broadcast_to(np.asarray(timestep, np.float32).reshape(-1), (batch,))
        if timestep_r is not None:
            inputs["timestep_r"] = np.broadcast_to(np.asarray(timestep_r, np.float32).reshape(-1), (batch,))
        out = np.asarray(self.forward(**inputs, timestep=t), np.float32)
        return np.asarray(hv.unpatchify(out, hv.latent_grid(x.shape, c), c))


class HunyuanVideo15Family(ModelFamily):
    name = "hunyuan-video15"
    display = "HunyuanVideo 1.5"
    checkpoints = hv_converters.CHECKPOINTS
    lora = hv_lora.LORA
    presets = {
        "hunyuanvideo1.5-480p": _preset(480, 848),
        "hunyuanvideo1.5-720p": _preset(720, 1280),
    }
    folder_classes = FOLDER_CLASSES
    pipeline_class = HunyuanVideo15Pipeline
    staged_model = hv_pipefusion.PipeFusionHunyuanVideo15
    # Its transformer has every hook of jaxdit.cache.hooks.CacheHooks (models/hunyuan_video15_cache_hooks.py);
    # TeaCache and MagCache take their numbers from a calibration (none are published).
    caches = ALL_CACHES
    makes_video = True
    fps = 24
    cfg_scale_argument = "guidance_scale"
    cfg_needs = "a guider scale > 1 (the folder's guider/guider_config.json, or --guidance_scale)"
    prediction_group = 0  # [video; prompt; glyph; image]
    default_branches = 2
    embedding_names = (
        "prompt_embeds",
        "prompt_embeds_mask",
        "prompt_embeds_2",
        "prompt_embeds_mask_2",
        "negative_prompt_embeds",
        "negative_prompt_embeds_mask",
        "negative_prompt_embeds_2",
        "negative_prompt_embeds_mask_2",
    )
    text_token_limit = (PROMPT_TOKENS, "the prompt tokens HunyuanVideo 1.5 keeps, as diffusers")
    example_prompt = 'a cat walks on the grass, a sign reading "hello", realistic'

    def preset_config(self, name: str) -> HunyuanVideo15Config:
        return HunyuanVideo15Config.preset(name)

    def bare_pipeline(self, model: Any, mesh: Mesh, **options: Any) -> HunyuanVideo15Pipeline:
        return HunyuanVideo15Pipeline(model, mesh, **options)

    def wrap(self, model: nnx.Module, mesh: Mesh, **options: Any) -> HunyuanVideo15Forward:
        return HunyuanVideo15Forward(model, mesh, **options)

    def example_request(self, w: Any) -> GenerationRequest:
        m, rows = w.model, w.requests
        height, width, frames = w.size
        text, glyph = w.tokens[1], w.tokens[2]
        branch = {
            "prompt_embeds": np.zeros((rows, text, m.text_embed_dim), np.float32),
            "prompt_embeds_mask": np.ones((rows, text), np.int64),
            "prompt_embeds_2": np.zeros((rows, glyph, m.text_embed_2_dim), np.float32),
            "prompt_embeds_mask_2": np.ones((rows, glyph), np.int64),
        }
        cfg = {f"negative_{k}": v for k, v in branch.items()} if w.branches == 2 else {}
        return GenerationRequest.of(
            **branch,
            **cfg,
            height=height,
            width=width,
            num_frames=frames,
            num_inference_steps=w.steps,
            guidance_scale=6.0 if w.branches == 2 else 1.0,
            output_type="latent",
        )

    # ------------------------------------------------------------------ jaxdit generate
    def generate_defaults(self, request: Any) -> dict[str, Any]:
        """The CFG scale of the folder's guider (diffusers reads it there, not from the call); a bare
        checkpoint: diffusers' guider default for the released folders, 6."""
        folder = request.folder
        return {"guidance_scale": read_guider(folder.root) if folder is not None else 6.0}

    def size_multiple(self, folder: ModelFolder | None) -> int:
        return SPATIAL  # the VAE's 16 x the 1 x 1 patches of the released models

    def check_generate(self, request: Any, config: HunyuanVideo15Config | None, parallel: Any) -> None:
        published = config is not None and config == HunyuanVideo15Config.preset("hunyuanvideo1.5-720p")
        check_calibrated_caches(request, self.display, magcache_published=published)
        frames = request.num_frames
        if frames is not None and (frames < 1 or (frames - 1) % TEMPORAL):
            raise ValueError(
                f"num_frames {frames} must be 4n + 1 (the VAE keeps the first frame and folds every 4 after "
                "it into one latent frame)"
            )

    def check_pipefusion(self, request: Any, config: Any, parallel: Any, multiple: int) -> None:
        """M >= P patches of whole latent rows (of every frame) that ring x ulysses splits, a dual-stream
        block per stage, 1 <= warmup_steps <= steps (the refiner's 2 blocks may leave stages with padded
        slots only: an identity)."""
        if config is not None:
            hv_pipefusion.check_model(config, parallel)
            if config.num_layers < parallel.pipefusion:
                raise ValueError(
                    f"--pipefusion_parallel_degree {parallel.pipefusion} exceeds the model's "
                    f"{config.num_layers} dual-stream blocks: every stage needs at least one"
                )
        p, pt = (1, 1) if config is None else (config.patch_size, config.patch_size_t)
        frames = (request.num_frames - 1) // TEMPORAL + 1
        grid = (frames // pt, request.height // SPATIAL // p, request.width // SPATIAL // p)
        patches = request.num_pipeline_patch
        if patches is None:
            patches = hv_pipefusion.default_num_patches(parallel.pipefusion, grid, parallel.sequence_degree)
        warmup = 1 if request.warmup_steps is None else request.warmup_steps
        validate_pipefusion(parallel.pipefusion, patches, warmup, request.num_inference_steps)
        hv_pipefusion.validate_patches(grid, patches, parallel.sequence_degree)

    # ------------------------------------------------------------------ jaxdit plan
    def pipefusion_max_stages(self, workload: Any) -> int:
        """As many stages as dual-stream blocks: the refiner's 2 blocks leave the stages beyond them
        padded slots, exact identities (tests/test_hunyuan_video15_pipefusion.py)."""
        return workload.stack_depths[-1]

    def pipefusion_patches(self, workload: Any, parallel: Any) -> int:
        """The runner's default count (``pipelines/pipefusion/hunyuan_video15.py``): the fewest M >= 2P
        that divide the latent rows (480p: 30 rows, so 5 on 2 stages), else the fewest M >= P."""
        height, width, frames = workload.size
        p, pt = workload.model.patch_size, workload.model.patch_size_t
        grid = (((frames - 1) // TEMPORAL + 1) // pt, height // SPATIAL // p, width // SPATIAL // p)
        return hv_pipefusion.default_num_patches(parallel.pipefusion, grid, parallel.sequence_degree)

    def workload_shape(self, config, height, width, frames, text_tokens):
        """(video, prompt, glyph) tokens: the text-to-video joint sequence's groups (no image tokens)."""
        if frames < 1 or (frames - 1) % TEMPORAL:
            raise ValueError(
                f"HunyuanVideo 1.5 needs 4n + 1 frames (the VAE compresses time 4x), got {frames}"
            )
        p = config.patch_size * SPATIAL
        if height % p or width % p:
            raise ValueError(f"height and width must be multiples of {p}, got {height}x{width}")
        latent = ((frames - 1) // TEMPORAL + 1, height // SPATIAL, width // SPATIAL)
        video = math.prod(latent) // math.prod(config.patch)
        text = PROMPT_TOKENS if text_tokens is None else text_tokens
        return (video, text, GLYPH_TOKENS), ()

    def output_features(self, config: HunyuanVideo15Config) -> int:
        return config.output_features

    def step_terms(self, w: Any, parallel: Any, sh: Any) -> StepTerms:
        """The blocks of ``models/hunyuan_video15_blocks.py``: the token refiner (q/k/v/out and a SiLU MLP
        on the prompt tokens, attending over them alone, a replicated 2E gate vector), the dual-stream
        blocks (q/k/v/out and a 4E MLP on every token, two replicated 6E modulations). The embedders and
        the output layer are replicated. Under PipeFusion the refiner's attention runs over the whole
        patch with the other groups' keys masked (``PatchContext.group_attention``): its q/k/v, Ulysses'
        exchanges and ring's hops cover every token of the patch. Parameter bytes are read off the abstract model's logical axes
        (a "heads" or "mlp" axis is split over tensor)."""
        m, e, b = w.model, w.hidden, sh.b
        n_vid, n_txt, n_gly = sh.local[:3]
        n_img = sh.local[3] if len(sh.local) > 3 else 0
        e_t, f_t, a = sh.e_t, sh.f_t, w.itemsize
        g = n_txt * parallel.ulysses
        refiner_attention = parallel.ring * attention_flops(b, sh.h_t // parallel.ulysses, g, g, w.head_dim)
        staged = parallel.pipefusion > 1
        if staged:  # the refiner attends over the whole patch, the other groups' keys masked
            refiner_attention = sh.self_attention_flops
        refiner = (
            2 * b * e * 2 * e + 2 * b * n_txt * e * e_t * 4 + 2 * b * n_txt * e * f_t * 2 + refiner_attention
        )
        dual = 2 * (2 * b * e * 6 * e) + 2 * b * sh.n * e * e_t * 4 + 2 * b * sh.n * e * f_t * 2
        dual += sh.self_attention_flops
        c3 = m.image_embed_dim
        nonblock = (
            2 * (2 * b * (TIME_FREQ_DIM * e + e * e))  # the two timestep embedders
            + 2 * b * (m.text_embed_dim * e + e * e)  # pooled prompt
            + 2 * b * n_vid * m.input_features * e  # patch embedding
            + 2 * b * n_txt * m.text_embed_dim * e  # proj_in
            + 2 * b * n_gly * (m.text_embed_2_dim * GLYPH_HIDDEN + GLYPH_HIDDEN**2 + GLYPH_HIDDEN * e)
            + 2 * b * n_img * (c3 * c3 + c3 * e)
            + 2 * b * e * 2 * e  # output AdaLN
            + 2 * b * n_vid * e * m.output_features  # proj_out
        )
        nonblock_params, block_params = 0, {name: 0 for name in ("refiner_blocks", "transformer_blocks")}
        model = hv.abstract_model(m)
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            size = math.prod(variable.shape)
            if any(axis in ("heads", "mlp") for axis in logical_axes(variable)):
                size //= parallel.tensor
            stack = str(path[0])
            if stack in block_params:
                block_params[stack] += size // variable.shape[0]
            else:
                nonblock_params += size
        n_cond = n_txt + n_gly + n_img
        reductions = (
            Reduction("token refiner: to_out and MLP-down partial sums", 0, 2, b * n_txt * e),
            Reduction("condition stream: to_add_out and MLP-down partial sums", 1, 2, b * n_cond * e),
            Reduction("video stream: to_out and MLP-down partial sums", 1, 2, b * n_vid * e),
        )
        return StepTerms(
            nonblock_flops=nonblock,
            block_flops=(refiner, dual),
            attention_flops=sh.self_attention_flops,
            param_nonblock_bytes=nonblock_params * a,
            param_block_bytes=(block_params["refiner_blocks"] * a, block_params["transformer_blocks"] * a),
            reductions=reductions,
            attention_tokens=() if staged else (n_txt, sh.n),
            masked_keys=True,
        )


HUNYUAN_VIDEO15 = HunyuanVideo15Family()
