"""Wan (2.1: T2V 1.3B / 14B, I2V 14B; 2.2: T2V / I2V A14B, TI2V-5B) as a jaxdit model family (see
``jaxdit.families.base``).

Ties ``models/wan.py`` (the transformer), ``converters/wan.py`` (original and diffusers checkpoints) and
``pipelines/wan.py`` (the text/image-to-video pipeline, both folder layouts, Wan 2.2's variants)
together, and adds the diffusers call surface of the forward (:class:`WanForward`), the presets, and the
cost terms ``jaxdit plan`` prices. Wan 2.2 is a variant of the family, not a family of its own: the same
blocks, with two experts (A14B: ``Preset.experts``, counted in memory when resident) or per-token
timesteps and the Wan 2.2 VAE (TI2V-5B: the VAE factors come from the config's latent width).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from converters import wan as wan_converters
from converters.lora import wan as wan_lora
from jaxdit.cache.hooks import ALL_CACHES
from jaxdit.families.base import ModelFamily, Preset, Reduction, StepTerms
from jaxdit.families.forward import as_float, expect_shape, per_batch
from jaxdit.models import wan
from jaxdit.parallel.flops import attention_flops
from jaxdit.parallel.pipefusion import validate_pipefusion
from jaxdit.pipelines.model_folder import ModelFolder, read_json
from jaxdit.pipelines.pipefusion.wan import PipeFusionWan, default_num_patches, validate_patches
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.pipelines.wan import (
    FOLDER_CLASSES,
    ORIGINAL_VAE_22,
    PRESET_VARIANTS,
    WanPipeline,
    WanVariant,
    check_folder,
    check_inputs,
    checkpoint_experts,
    nearest,
    open_original_folder,
)
from jaxdit.vae.wan_vae_config import WanVAEConfig

__all__ = ["WAN", "WanFamily", "WanForward"]

#: CLIP ViT-H/14 image tokens of Wan 2.1 I2V (penultimate layer, 257 x 1280).
IMAGE_TOKENS = 257
#: The Wan 2.1 VAE's spatial and temporal compression (the Wan 2.2 VAE's: ``WanConfig.vae_factors``).
VAE_SPATIAL, VAE_TEMPORAL = 8, 4
#: CLIP ViT-H/14 feature width (I2V's image context).
CLIP_DIM = 1280


class WanForward:
    """A Wan transformer on a mesh, called like diffusers' ``WanTransformer3DModel.forward``.

    ``hidden_states`` [B, C, F, H, W] latents (C = 16, 36 for I2V: noise, mask, condition; 48 for TI2V),
    ``timestep`` [B] (or a scalar) in [0, 1000), or [B, N] per video token (Wan 2.2 TI2V: each token's
    timestep is its sample's t or 0, the same tokens at 0 in every sample, as diffusers' pipeline makes
    them), ``encoder_hidden_states`` [B, T, 4096] umT5 tokens (the original model zero-pads them to 512),
    ``encoder_hidden_states_image`` [B, 257, 1280] CLIP features for Wan 2.1 I2V, else None. numpy or jax
    arrays; returns [B, C_out, F, H, W] as an fp32 jax array (as the original model does). Any F, H, W
    that the patch divides: the video tokens are padded for the mesh and the padding removed.
    """

    def __init__(self, model: nnx.Module, mesh: Mesh, **options: Any) -> None:
        self.config = model.config
        self.mesh = mesh
        self.dtype = model.dtype
        self.forward = wan.sharded(model, mesh, **options)

    @property
    def params(self) -> nnx.State:
        return self.forward.state

    def __call__(
        self,
        hidden_states: Any,
        timestep: Any,
        encoder_hidden_states: Any,
        encoder_hidden_states_image: Any = None,
    ) -> jax.Array:
        cfg = self.config
        shape = np.shape(hidden_states)
        if len(shape) != 5 or shape[1] != cfg.in_channels:
            raise ValueError(f"hidden_states has shape {shape}; expected [B, {cfg.in_channels}, F, H, W]")
        sizes = {"B": shape[0]}
        expect_shape("encoder_hidden_states", encoder_hidden_states, ("B", "T", cfg.text_dim), sizes)
        image = encoder_hidden_states_image
        if image is not None and cfg.image_dim is not None:  # its presence is checked by the forward
            expect_shape("encoder_hidden_states_image", image, ("B", "I", cfg.image_dim), sizes)
        grid = wan.latent_grid(shape, cfg.patch_size)
        timestep, mask = per_token_timestep(timestep, shape[0], math.prod(grid))
        out = self.forward(
            hidden_states=wan.patchify(as_float(hidden_states, self.dtype), cfg.patch_size),
            positions=wan.token_positions(grid),
            timestep=per_batch(timestep, shape[0], "timestep"),
            encoder_hidden_states=as_float(encoder_hidden_states, self.dtype),
            encoder_hidden_states_image=None if image is None else as_float(image, self.dtype),
            timestep_mask=mask,
        )
        return wan.unpatchify(out, grid, cfg.patch_size, cfg.out_channels)


def per_token_timestep(timestep: Any, batch: int, tokens: int) -> tuple[Any, np.ndarray | None]:
    """diffusers' [B, N] per-token timesteps -> ([B] timesteps, [N] 0/1 mask) as the model takes them;
    anything else passes through (mask None). Every token must see its sample's t (the row's largest
    value) or 0, the same tokens at 0 in every row; other patterns are not what Wan 2.2 makes."""
    if np.ndim(timestep) != 2:
        return timestep, None
    ts = np.asarray(timestep, np.float32)
    if ts.shape != (batch, tokens):
        raise ValueError(
            f"per-token timestep has shape {ts.shape}; expected ({batch}, {tokens}) video tokens"
        )
    t = ts.max(axis=1)
    mask = ts == t[:, None]
    if not (mask | (ts == 0)).all() or not (mask == mask[:1]).all():
        raise ValueError(
            "per-token timesteps must be each sample's t or 0, with the same tokens at 0 in every sample "
            "(Wan 2.2 TI2V's first frame)"
        )
    return t, mask[0].astype(np.float32)


def _preset(steps: int, height: int, width: int, kind: str, frames: int = 81, experts: int = 1) -> Preset:
    return Preset(steps, height, width, frames=frames, branches=2, kind=kind, experts=experts)


class WanFamily(ModelFamily):
    name = "wan"
    caches = ALL_CACHES  # its transformer has every hook of jaxdit.cache.hooks.CacheHooks
    display = "Wan"
    checkpoints = wan_converters.CHECKPOINTS
    lora = wan_lora.LORA
    presets = {
        "wan2.1-t2v-1.3b": _preset(50, 480, 832, "wan-t2v"),
        "wan2.1-t2v-14b": _preset(50, 720, 1280, "wan-t2v"),
        "wan2.1-i2v-14b": _preset(40, 720, 1280, "wan-i2v"),
        # Wan2.2 repository wan/configs: 40 steps at 720p for A14B (two 14B experts), 50 steps at
        # 1280 x 704 and 121 frames for TI2V-5B.
        "wan2.2-t2v-a14b": _preset(40, 720, 1280, "wan2.2-t2v", experts=2),
        "wan2.2-i2v-a14b": _preset(40, 720, 1280, "wan2.2-i2v", experts=2),
        "wan2.2-ti2v-5b": _preset(50, 704, 1280, "wan2.2-ti2v", frames=121),
    }
    folder_classes = FOLDER_CLASSES
    pipeline_class = WanPipeline
    staged_model = PipeFusionWan
    makes_video = True
    default_branches = 2  # Wan runs classifier-free guidance (guidance_scale 5.0)
    fps = 16  # Wan 2.1 is trained at 16 fps
    cfg_scale_argument = "guidance_scale"
    cfg_needs = "--guidance_scale > 1 (Wan's CFG)"
    embedding_names = ("prompt_embeds", "negative_prompt_embeds", "image_embeds", "condition")

    def example_request(self, w: Any) -> GenerationRequest:
        m, rows, (height, width, frames) = w.model, w.requests, w.size
        embeds = np.zeros((rows, w.context[0], m.text_dim), np.float32)
        image = {}
        temporal, spatial = m.vae_factors
        latent = ((frames - 1) // temporal + 1, height // spatial, width // spatial)
        if m.condition_channels:
            image["condition"] = np.zeros((rows, m.condition_channels, *latent), np.float32)
        if m.is_i2v:
            image["image_embeds"] = np.zeros((rows, w.context[1], m.image_dim), np.float32)
        return GenerationRequest(
            prompt_embeds=embeds,
            negative_prompt_embeds=embeds if w.branches == 2 else None,
            guidance_scale=5.0 if w.branches == 2 else 1.0,
            height=height,
            width=width,
            num_frames=frames,
            num_inference_steps=w.steps,
            output_type="latent",
            **image,
        )

    def size_multiple(self, folder: ModelFolder | None) -> int:
        return vae_factors(folder)[1] * 2  # the VAE's 8 (Wan 2.2's 16) x the 2x2 patches

    def image_input(self, folder: ModelFolder) -> str:
        """TI2V takes a first frame or not; the I2V kinds need one; T2V takes none."""
        if WanVariant.of(folder).expand_timesteps:
            return "optional"
        return super().image_input(folder)

    def video_fps(self, folder: ModelFolder | None) -> int:
        return self.fps if folder is None else WanVariant.of(folder).fps

    def checkpoint_config(self, path: Path) -> wan.WanConfig:
        """As the base's; a folder of Wan 2.2 A14B's two experts answers with its high-noise expert's."""
        return super().checkpoint_config(checkpoint_experts(path)[0][0] if path.is_dir() else path)

    def check_generate(self, request: Any, config: wan.WanConfig | None, parallel: Any) -> None:
        folder, preset = getattr(request, "folder", None), getattr(request, "model", None)
        weights = getattr(request, "weights", None)
        if folder is not None:
            variant = WanVariant.of(folder)
        elif preset in PRESET_VARIANTS or weights is None or not Path(weights).is_dir():
            variant = PRESET_VARIANTS.get(preset, WanVariant())
        else:  # a checkpoint folder without a Wan 2.2 preset: one expert or two
            variant = checkpoint_experts(Path(weights))[1]
        two = variant.boundary_ratio is not None
        if getattr(request, "guidance_scale_2", None) is not None and not two:
            raise ValueError(
                "--guidance_scale_2 is the low-noise expert's guidance scale: only Wan 2.2 A14B (two experts) "
                "takes it"
            )
        if getattr(request, "offload_idle_expert", False) and not two:
            raise ValueError("--offload_idle_expert applies to Wan 2.2 A14B (two experts)")
        if getattr(request, "lora_2", ()) and not two:
            raise ValueError(
                "--lora_2 goes into Wan 2.2 A14B's low-noise expert (transformer_2); this model has one "
                "transformer: use --lora"
            )
        frames = request.num_frames
        if frames < 1 or (frames - 1) % VAE_TEMPORAL:
            raise ValueError(
                f"num_frames {frames} must be 4n + 1 (the VAE keeps the first frame and folds every 4 after "
                f"it into one latent frame); nearest: {nearest(frames, VAE_TEMPORAL, 1)}"
            )
        if config is not None and request.embeddings is not None:
            # The pipeline's own checks, on the file's shapes (PipeFusion's split is checked apart).
            check_inputs(
                config,
                dataclasses.replace(parallel, pipefusion=1),
                height=request.height,
                width=request.width,
                num_frames=frames,
                num_inference_steps=request.num_inference_steps,
                guidance_scale=request.guidance_scale,
                prompt_embeds=request.embeddings["prompt_embeds"],
                negative_prompt_embeds=request.embeddings.get("negative_prompt_embeds"),
                image_embeds=request.embeddings.get("image_embeds"),
                condition=request.embeddings.get("condition"),
                flow_shift=request.flow_shift,
                vae_scale_factor_spatial=config.vae_factors[1],
                vae_scale_factor_temporal=config.vae_factors[0],
                expand_timesteps=variant.expand_timesteps,
                two_experts=two,
                guidance_scale_2=getattr(request, "guidance_scale_2", None),
            )

    def check_pipefusion(self, request: Any, config: wan.WanConfig, parallel: Any, multiple: int) -> None:
        """M >= P patches of whole latent rows (after patchify) that ring x ulysses splits, blocks to split
        over the stages, 1 <= warmup_steps <= steps. Every variant runs (Wan 2.2 A14B: one PipeFusion run
        per expert segment, an expert's segment shorter than the warm-up running synchronously)."""
        if config.num_layers < parallel.pipefusion:
            raise ValueError(
                f"--pipefusion_parallel_degree {parallel.pipefusion} exceeds the model's {config.num_layers} "
                "blocks: every stage needs at least one block"
            )
        temporal, spatial = config.vae_factors
        latent = (1, config.out_channels, (request.num_frames - 1) // temporal + 1)
        latent += (request.height // spatial, request.width // spatial)
        grid = wan.latent_grid(latent, config.patch_size)
        patches = request.num_pipeline_patch
        if patches is None:
            patches = default_num_patches(parallel.pipefusion, grid, parallel.sequence_degree)
        validate_pipefusion(
            parallel.pipefusion,
            patches,
            1 if request.warmup_steps is None else request.warmup_steps,
            request.num_inference_steps,
        )
        validate_patches(grid, patches, parallel.sequence_degree)

    def original_folder(self, root: Path) -> ModelFolder | None:
        return open_original_folder(root)

    def check_folder(self, folder: ModelFolder) -> None:
        check_folder(folder)

    def wrap(self, model: nnx.Module, mesh: Mesh, **options: Any) -> WanForward:
        return WanForward(model, mesh, **options)

    def output_features(self, config: wan.WanConfig) -> int:
        return config.out_features

    def prediction_dtype(self, dtype: str) -> str:
        return "float32"  # Wan's head returns fp32 whatever the model's dtype

    def step_terms(self, w: Any, parallel: Any, sh: Any) -> StepTerms:
        """Wan's blocks (``models/wan_blocks.py``): self-attention (q, k, v, o + sequence-parallel attention),
        cross-attention to the context (its K/V computed on every sequence shard), FFN; the time path,
        norms and modulation in fp32; q/k RMSNorm across all heads (two small all-reduces per block
        under tensor parallelism)."""
        m, e, b, n = w.model, w.hidden, sh.b, sh.n
        e_t, f_t, text = sh.e_t, sh.f_t, w.context[0]
        nonblock = (
            2 * b * n * m.patch_features * e  # patch embedding
            + 2 * b * text * (m.text_dim * e + e * e)  # text embedding: every shard embeds the whole prompt
            + 2 * b * (m.freq_dim * e + e * e)  # time embedding
            + 2 * b * e * 6 * e  # time projection
            + 2 * b * n * e * m.out_features  # head
        )
        att = sh.self_attention_flops
        block = (
            2 * b * n * e * e_t * 4  # self-attention q, k, v, o
            + att
            + 2 * b * n * e * e_t * 2  # cross-attention q, o
            + 2 * b * text * e * e_t * 2  # cross-attention text k, v: on every sequence shard
            + attention_flops(b, sh.h_t, n, text, w.head_dim)
            + 2 * b * n * e * f_t * 2  # FFN
        )
        a = w.itemsize  # matmul weights in the model dtype; norms, modulation, time path in fp32
        param_nonblock = (
            (m.patch_features * e + e) * a
            + (m.text_dim * e + e + e * e + e) * a
            + (m.freq_dim * e + e + e * e + e + e * 6 * e + 6 * e) * 4  # time embedding + projection
            + 2 * e * 4  # head modulation
            + (e * m.out_features + m.out_features) * a
        )
        attn = 3 * (e * e_t + e_t) + e_t * e + e  # q, k, v column-parallel, o row-parallel (bias replicated)
        param_block = (
            6 * e * 4  # modulation
            + attn * a
            + 2 * e_t * 4  # self-attention q/k RMSNorm weights ("heads": split over tensor)
            + 2 * e * 4  # cross-attention LayerNorm
            + attn * a
            + 2 * e_t * 4
            + (e * f_t + f_t + f_t * e + e) * a
        )
        if m.is_i2v:
            image = w.context[1]
            nonblock += 2 * b * image * (CLIP_DIM * CLIP_DIM + CLIP_DIM * e)
            block += 2 * b * image * e * e_t * 2 + attention_flops(b, sh.h_t, n, image, w.head_dim)
            param_nonblock += 2 * CLIP_DIM * 4 + (CLIP_DIM * CLIP_DIM + CLIP_DIM + CLIP_DIM * e + e) * a
            param_nonblock += 2 * e * 4
            param_block += 2 * (e * e_t + e_t) * a + e_t * 4
        context = sum(w.context)
        reductions = (
            Reduction("self-attention o, cross-attention o, FFN-down partial sums", 0, 3, b * n * e),
            Reduction("RMSNorm sums of squares across heads: self q, k", 0, 1, b * 2 * n),
            Reduction("RMSNorm sums of squares across heads: cross q, context k", 0, 1, b * (n + context)),
        )
        return StepTerms(
            nonblock_flops=nonblock,
            block_flops=(block,),
            attention_flops=att,
            param_nonblock_bytes=param_nonblock,
            param_block_bytes=(param_block,),
            reductions=reductions,
            context_bytes=b * context * e * a + 2 * b * context * e_t * a,
        )

    def workload_shape(self, config, height, width, frames, text_tokens):
        temporal, spatial = config.vae_factors
        if frames < 1 or (frames - 1) % temporal:
            raise ValueError(f"Wan needs 4n + 1 frames (the VAE compresses time 4x), got {frames}")
        pt, ph, pw = config.patch_size
        if height % (spatial * ph) or width % (spatial * pw):
            raise ValueError(
                f"height and width must be multiples of {spatial * ph} (the VAE's {spatial} x the patch), "
                f"got {height}x{width}"
            )
        latent = ((frames - 1) // temporal + 1, height // spatial, width // spatial)
        if latent[0] % pt or latent[1] % ph or latent[2] % pw:
            raise ValueError(f"latent {latent} is not a multiple of the patch {config.patch_size}")
        video = math.prod((latent[0] // pt, latent[1] // ph, latent[2] // pw))
        text = wan.TEXT_LEN if text_tokens is None else text_tokens
        return (video,), ((text, IMAGE_TOKENS) if config.is_i2v else (text,))


def vae_factors(folder: ModelFolder | None) -> tuple[int, int]:
    """(temporal, spatial) compression of a folder's VAE (diffusers' ``vae/config.json``, or the original
    release's VAE file: ``Wan2.2_VAE.pth`` is 4 x 16 x 16); Wan 2.1's without a folder."""
    if folder is None:
        return VAE_TEMPORAL, VAE_SPATIAL
    vae = folder["vae"]
    if vae.is_dir():
        config = WanVAEConfig.from_diffusers(read_json(vae / "config.json"))  # a missing file is named
        return config.temporal_factor, config.spatial_factor
    return (4, 16) if vae.name == ORIGINAL_VAE_22 else (VAE_TEMPORAL, VAE_SPATIAL)


WAN = WanFamily()
