"""Z-Image (Turbo and base) as a jaxdit model family (see ``jaxdit.families.base``).

Ties ``models/z_image.py`` (the single-stream transformer), ``converters/z_image.py`` (diffusers
checkpoints) and ``pipelines/z_image.py`` (the text-to-image pipeline with the Qwen3 encoder and FLUX's
AutoencoderKL) together, and adds the diffusers call surface of the forward (:class:`ZImageForward`), the
presets and the cost terms ``jaxdit plan`` prices.

Turbo and the base model share one architecture and one folder class; what differs is the call: Turbo
runs 8 steps with ``--guidance_scale 0`` (no negative branch at all, so ``--use_cfg_parallel`` is refused),
the base model 50 steps with guidance (diffusers' defaults: 50 steps, scale 5).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from converters import z_image as z_image_converters
from converters.lora import z_image as z_image_lora
from jaxdit.families.base import ModelFamily, Preset, Reduction, StepTerms, check_calibrated_caches
from jaxdit.models import z_image
from jaxdit.models.z_image_config import TIME_HIDDEN, ZImageConfig
from jaxdit.models.z_image_tokens import padded, sequence_inputs, unpack
from jaxdit.parallel.flops import attention_flops
from jaxdit.parallel.pipefusion import validate_pipefusion
from jaxdit.pipelines.model_folder import ModelFolder, read_json
from jaxdit.pipelines.pipefusion.flux import validate_patches
from jaxdit.pipelines.pipefusion.z_image import PipeFusionZImage, default_num_patches, validate_grid
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.pipelines.z_image import FOLDER_CLASSES, ZImagePipeline

__all__ = ["Z_IMAGE", "ZImageFamily", "ZImageForward"]

#: Caption tokens ``jaxdit plan`` counts when not told: a typical templated prompt, padded to 32.
TEXT_LEN = 128


class ZImageForward:
    """A Z-Image transformer on a mesh, called like diffusers' ``ZImageTransformer2DModel.forward``:
    ``x`` latents [B, C, H, W] (or diffusers' list of [C, 1, H, W]), ``t`` [B] in [0, 1] (1 = clean),
    ``cap_feats`` one [L_i, cap_feat_dim] array per sample. Returns the prediction [B, C, H, W] (numpy,
    diffusers' sign)."""

    def __init__(self, model: nnx.Module, mesh: Mesh, **options: Any) -> None:
        self.config: ZImageConfig = model.config
        self.mesh = mesh
        self.forward = z_image.sharded(model, mesh, **options)

    @property
    def params(self) -> nnx.State:
        return self.forward.state

    def __call__(self, x: Any, t: Any, cap_feats: Any) -> np.ndarray:
        if isinstance(x, list | tuple):
            x = np.stack([np.asarray(xi, np.float32)[:, 0] for xi in x])
        x = np.asarray(x, np.float32)
        c = self.config
        if x.ndim != 4 or x.shape[1] != c.in_channels:
            raise ValueError(f"x has shape {x.shape}; expected [B, {c.in_channels}, H, W]")
        caps = [np.asarray(f, np.float32) for f in cap_feats]
        if any(f.ndim != 2 or f.shape[1] != c.cap_feat_dim for f in caps):
            raise ValueError(f"cap_feats must be [L_i, {c.cap_feat_dim}] arrays, one per sample")
        t = np.broadcast_to(np.asarray(t, np.float32).reshape(-1), (x.shape[0],))
        inputs = {k: v for k, v in sequence_inputs(x, caps, c).items() if v is not None}
        out = np.asarray(self.forward(**inputs, timestep=t), np.float32)
        return unpack(out, c.in_channels, x.shape[2], x.shape[3], c.patch_size)


class ZImageFamily(ModelFamily):
    name = "z-image"
    # TeaCache and MagCache run from a calibration's file: none are published for Z-Image.
    caches = frozenset({"fbcache", "dbcache", "taylorseer", "teacache", "magcache"})
    display = "Z-Image"
    several_prompts = True
    checkpoints = z_image_converters.CHECKPOINTS
    lora = z_image_lora.LORA
    presets = {
        "z-image-turbo": Preset(steps=8, height=1024, width=1024, kind="z-image"),
        "z-image": Preset(steps=50, height=1024, width=1024, branches=2, kind="z-image"),
    }
    folder_classes = FOLDER_CLASSES
    pipeline_class = ZImagePipeline
    staged_model = PipeFusionZImage
    cfg_scale_argument = "guidance_scale"
    prediction_group = 0  # [image; caption]
    cfg_above = 0.0  # diffusers' ZImagePipeline guides for any scale > 0
    cfg_needs = (
        "--guidance_scale > 0 (the base model; Z-Image-Turbo runs with --guidance_scale 0, one branch)"
    )
    default_branches = 2
    embedding_names = ("prompt_embeds", "negative_prompt_embeds")

    def bare_pipeline(self, model: Any, mesh: Mesh, **options: Any) -> ZImagePipeline:
        return ZImagePipeline(model, mesh, **options)

    def example_request(self, w: Any) -> GenerationRequest:
        m, (_, text), rows = w.model, w.tokens, w.requests
        embeds = [np.zeros((text, m.cap_feat_dim), np.float32)] * rows
        height, width, _ = w.size
        cfg = dict(negative_prompt_embeds=embeds, guidance_scale=2.0) if w.branches == 2 else {}
        return GenerationRequest(
            prompt_embeds=embeds,
            height=height,
            width=width,
            num_inference_steps=w.steps,
            output_type="latent",
            guidance_scale=cfg.pop("guidance_scale", 0.0),
            **cfg,
        )

    def size_multiple(self, folder: ModelFolder | None) -> int:
        """The VAE's factor (2 per level after the first: 8 for FLUX's) x the 2x2 patches."""
        if folder is None:
            return 16
        levels = len(read_json(folder["vae"] / "config.json").get("block_out_channels", (0,) * 4))
        return 2 ** (levels - 1) * 2

    def check_generate(self, request: Any, config: ZImageConfig | None, parallel: Any) -> None:
        """TeaCache and MagCache come with a calibration's file; an embeddings file: prompt_embeds [B, L,
        cap_feat_dim] (every prompt L tokens), negatives alike."""
        check_calibrated_caches(request, "Z-Image")
        shapes = request.embeddings
        if config is None or shapes is None:
            return
        if "prompt_embeds" not in shapes:
            raise ValueError("the embeddings file has no prompt_embeds (Z-Image needs [B, L, cap_feat_dim])")
        for key in ("prompt_embeds", "negative_prompt_embeds"):
            got = shapes.get(key)
            if got is not None and (len(got) != 3 or got[-1] != config.cap_feat_dim):
                raise ValueError(
                    f"{key} has shape {tuple(got)}; this model takes [B, L, {config.cap_feat_dim}]"
                )

    def check_pipefusion(self, request: Any, config: Any, parallel: Any, multiple: int) -> None:
        """Whole rows of patch tokens (no image pad tokens) that ring x ulysses splits, M >= P patches,
        1 <= warm-up <= steps."""
        rows, cols = request.height // multiple, request.width // multiple
        validate_grid(rows, cols)
        patches = request.num_pipeline_patch
        if patches is None:
            patches = default_num_patches(parallel.pipefusion, rows, cols, parallel.sequence_degree)
        warmup = 1 if request.warmup_steps is None else request.warmup_steps
        validate_pipefusion(parallel.pipefusion, patches, warmup, request.num_inference_steps)
        validate_patches(rows, cols, patches, parallel.sequence_degree)

    def pipefusion_max_stages(self, workload: Any) -> int:
        """As many stages as joint layers: the 2 refiner blocks of a stream leave the stages beyond them
        padded slots, exact identities (the tiny model's one refiner block runs on 2 stages in
        tests/test_z_image_cli.py)."""
        return workload.stack_depths[-1]

    def pipefusion_patches(self, workload: Any, parallel: Any) -> int:
        """The runner's default count (``pipelines/pipefusion/z_image.py``): 3P would not divide 1024 x
        1024's 64 rows, so a full pipeline there is the next count that does."""
        height, width, _ = workload.size
        return default_num_patches(parallel.pipefusion, height // 16, width // 16, parallel.sequence_degree)

    def wrap(self, model: nnx.Module, mesh: Mesh, **options: Any) -> ZImageForward:
        return ZImageForward(model, mesh, **options)

    def output_features(self, config: ZImageConfig) -> int:
        return config.output_features

    def workload_shape(self, config, height, width, frames, text_tokens):
        """(image tokens padded to 32, caption tokens padded to 32): the joint sequence's two groups."""
        if frames != 1:
            raise ValueError(f"Z-Image makes images: frames must be 1, got {frames}")
        image = (height // 16) * (width // 16)
        return (padded(image), padded(TEXT_LEN if text_tokens is None else text_tokens)), ()

    def step_terms(self, w: Any, parallel: Any, sh: Any) -> StepTerms:
        """Z-Image's blocks (``models/z_image.py``): q/k/v/out and the SwiGLU (w1, w3, w2) on every token
        of the stream a block runs on; the noise refiner on the image tokens, the context refiner on the
        caption tokens (each attending over its own group), the joint layers on both; a replicated 4E
        modulation in the modulated blocks. Embedders and the final layer replicated.

        Under PipeFusion a refiner's attention runs over the whole patch with the other group's keys
        masked (``PatchContext.group_attention``): its q/k/v, Ulysses' exchanges and ring's hops cover
        every token of the patch, while its projections and MLP stay on its own group."""
        m, e, b = w.model, w.hidden, sh.b
        n_img, n_cap = sh.local
        e_t, f_t, a = sh.e_t, sh.f_t, w.itemsize
        adaln = m.adaln_dim

        def block(n: int, att: float, modulated: bool) -> float:
            mod = 2 * b * adaln * 4 * e if modulated else 0
            return mod + 2 * b * n * e * e_t * 4 + 2 * b * n * e * f_t * 3 + att

        staged = parallel.pipefusion > 1

        def group_attention(n: int) -> float:
            if staged:
                return sh.self_attention_flops
            g = n * parallel.ulysses
            return parallel.ring * attention_flops(b, sh.h_t // parallel.ulysses, g, g, w.head_dim)

        att = sh.self_attention_flops
        nonblock = (
            2 * b * (256 * TIME_HIDDEN + TIME_HIDDEN * adaln)
            + 2 * b * n_img * m.output_features * e  # x embedder
            + 2 * b * n_cap * m.cap_feat_dim * e  # caption embedder
            + 2 * b * adaln * e  # final modulation
            + 2 * b * n_img * e * m.output_features  # final linear
        )
        norms = 4 * e + 2 * m.head_dim
        plain = 4 * e * e_t + 3 * e * f_t + norms  # q, k, v, out; w1, w3, w2
        modulated = plain + adaln * 4 * e + 4 * e
        params_nonblock = (
            256 * TIME_HIDDEN + TIME_HIDDEN + TIME_HIDDEN * adaln + adaln
            + m.output_features * e + e + m.cap_feat_dim + m.cap_feat_dim * e + e + 2 * e
            + adaln * e + e + e * m.output_features + m.output_features
        )  # fmt: skip
        reductions = (
            Reduction("noise refiner: attention-out and w2 partial sums", 0, 2, b * n_img * e),
            Reduction("context refiner: attention-out and w2 partial sums", 1, 2, b * n_cap * e),
            Reduction("joint layers: attention-out and w2 partial sums", 2, 2, b * (n_img + n_cap) * e),
        )
        return StepTerms(
            nonblock_flops=nonblock,
            block_flops=(
                block(n_img, group_attention(n_img), True),
                block(n_cap, group_attention(n_cap), False),
                block(n_img + n_cap, att, True),
            ),
            attention_flops=att,
            param_nonblock_bytes=params_nonblock * a,
            param_block_bytes=(modulated * a, plain * a, modulated * a),
            reductions=reductions,
            attention_tokens=() if staged else (n_img, n_cap, n_img + n_cap),
        )


Z_IMAGE = ZImageFamily()
