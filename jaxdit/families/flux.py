"""FLUX.1 [dev] / [schnell] as a jaxdit model family (see ``jaxdit.families.base``).

Ties ``models/flux.py`` (the transformer), ``converters/flux.py`` (BFL and diffusers checkpoints) and
``pipelines/flux.py`` (the text-to-image pipeline, ``tiny-digits`` included) together, and adds the
diffusers call surface of the forward (:class:`FluxForward`), the presets, and the cost terms
``jaxdit plan`` prices.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from converters import flux as flux_converters
from converters.lora import flux as flux_lora
from jaxdit.cache.hooks import ALL_CACHES
from jaxdit.families.base import ModelFamily, Preset, Reduction, StepTerms
from jaxdit.families.forward import as_float, expect_shape, per_batch
from jaxdit.models import flux
from jaxdit.parallel.pipefusion import validate_pipefusion
from jaxdit.pipelines.flux import FOLDER_CLASSES, FluxPipeline
from jaxdit.pipelines.model_folder import ModelFolder, read_json
from jaxdit.pipelines.pipefusion.flux import PipeFusionFlux, default_num_patches, validate_patches
from jaxdit.pipelines.request import GenerationRequest

__all__ = ["FLUX", "FluxFamily", "FluxForward"]

#: T5 tokens FLUX pipelines pad the prompt to (diffusers' ``max_sequence_length`` default).
TEXT_LEN = 512
#: VAE spatial compression x the 2x2 token patches.
PIXELS_PER_TOKEN = 16
#: Width of the sinusoidal time / guidance embedding.
FREQ_DIM = flux.TIME_FREQ_DIM


class FluxForward:
    """A FLUX transformer on a mesh, called like diffusers' ``FluxTransformer2DModel.forward``.

    ``hidden_states`` [B, N, 64] packed latents, ``encoder_hidden_states`` [B, T, 4096] T5 tokens,
    ``pooled_projections`` [B, 768] CLIP pooled, ``timestep`` [B] (or a scalar) sigma in [0, 1],
    ``img_ids`` [N, 3], ``txt_ids`` [T, 3] (3-D ids use the first batch entry, as diffusers does),
    ``guidance`` [B] (or a scalar) for dev, None for schnell. numpy or jax arrays; returns the prediction
    [B, N, 64] as a jax array in the model's dtype. Any N and T: the sequence is padded for the mesh and
    the padding removed.
    """

    def __init__(self, model: nnx.Module, mesh: Mesh, **options: Any) -> None:
        self.config = model.config
        self.mesh = mesh
        self.dtype = model.dtype
        self.forward = flux.sharded(model, mesh, **options)

    @property
    def params(self) -> nnx.State:
        return self.forward.state

    def __call__(
        self,
        hidden_states: Any,
        encoder_hidden_states: Any,
        pooled_projections: Any,
        timestep: Any,
        img_ids: Any,
        txt_ids: Any,
        guidance: Any = None,
    ) -> jax.Array:
        c, sizes = self.config, {}
        expect_shape("hidden_states", hidden_states, ("B", "N", c.in_channels), sizes)
        expect_shape("encoder_hidden_states", encoder_hidden_states, ("B", "T", c.context_in_dim), sizes)
        expect_shape("pooled_projections", pooled_projections, ("B", c.vec_in_dim), sizes)
        batch = sizes["B"]
        if self.config.guidance_embed and guidance is None:
            raise ValueError("this FLUX model embeds the guidance scale (dev): pass guidance=")
        if not self.config.guidance_embed and guidance is not None:
            raise ValueError("this FLUX model has no guidance embedding (schnell); pass guidance=None")

        def ids(x: Any, name: str) -> Any:
            x = as_float(x, jnp.float32)
            if x.ndim == 3:  # deprecated batched ids: diffusers takes the first
                x = x[0]
            if x.ndim != 2 or x.shape[1] != 3:
                raise ValueError(f"{name} has shape {x.shape}; expected (tokens, 3)")
            return x

        return self.forward(
            hidden_states=as_float(hidden_states, self.dtype),
            encoder_hidden_states=as_float(encoder_hidden_states, self.dtype),
            pooled_projections=as_float(pooled_projections, self.dtype),
            timestep=per_batch(timestep, batch, "timestep"),
            img_ids=ids(img_ids, "img_ids"),
            txt_ids=ids(txt_ids, "txt_ids"),
            guidance=None if guidance is None else per_batch(guidance, batch, "guidance"),
        )


class FluxFamily(ModelFamily):
    name = "flux"
    caches = ALL_CACHES  # its transformer has every hook of jaxdit.cache.hooks.CacheHooks
    display = "FLUX.1"
    checkpoints = flux_converters.CHECKPOINTS
    lora = flux_lora.LORA
    presets = {
        "flux-dev": Preset(steps=28, height=1024, width=1024, kind="flux"),
        "flux-schnell": Preset(steps=4, height=1024, width=1024, kind="flux"),
    }
    folder_classes = FOLDER_CLASSES
    pipeline_class = FluxPipeline
    staged_model = PipeFusionFlux
    cfg_note = "FLUX.1's guidance is a distilled input"
    cfg_scale_argument = "true_cfg_scale"
    cfg_needs = (
        "a --negative_prompt (or negative embeddings) and --true_cfg_scale > 1; FLUX-dev's embedded "
        "guidance needs no CFG"
    )
    embedding_names = (
        "prompt_embeds",
        "pooled_prompt_embeds",
        "negative_prompt_embeds",
        "negative_pooled_prompt_embeds",
    )

    def bare_pipeline(self, model: Any, mesh: Mesh, **options: Any) -> FluxPipeline:
        return FluxPipeline(model, mesh, latent_channels=model.config.in_channels // 4, **options)

    def example_request(self, w: Any) -> GenerationRequest:
        m, (text, _), rows = w.model, w.tokens, w.requests
        embeds = np.zeros((rows, text, m.context_in_dim), np.float32)
        pooled = np.zeros((rows, m.vec_in_dim), np.float32)
        cfg = {}
        if w.branches == 2:
            cfg = dict(
                negative_prompt_embeds=embeds, negative_pooled_prompt_embeds=pooled, true_cfg_scale=2.0
            )
        height, width, _ = w.size
        return GenerationRequest(
            prompt_embeds=embeds,
            pooled_prompt_embeds=pooled,
            height=height,
            width=width,
            num_inference_steps=w.steps,
            output_type="latent",
            **cfg,
        )

    def size_multiple(self, folder: ModelFolder | None) -> int:
        """The VAE's factor (2 per level after the first, read from the folder's vae/config.json; 8
        for FLUX.1) x the 2x2 token patches."""
        if folder is None:
            return PIXELS_PER_TOKEN
        levels = len(read_json(folder["vae"] / "config.json").get("block_out_channels", (0,) * 4))
        return 2 ** (levels - 1) * 2

    def check_generate(self, request: Any, config: flux.FluxConfig | None, parallel: Any) -> None:
        """An embeddings file against the model before any weight loads: T5 tokens [B, T, context width],
        CLIP pooled [B, pooled width], negatives shaped like them."""
        shapes = request.embeddings
        if config is None or shapes is None:
            return
        expected = {
            "prompt_embeds": ("B", "T", config.context_in_dim),
            "pooled_prompt_embeds": ("B", config.vec_in_dim),
        }
        for name in ("prompt_embeds", "pooled_prompt_embeds"):
            if name not in shapes:
                raise ValueError(f"the embeddings file has no {name} (FLUX needs {', '.join(expected)})")
        for name, want in expected.items():
            for key in (name, "negative_" + name):
                got = shapes.get(key)
                if got is None:
                    continue
                if len(got) != len(want) or got[-1] != want[-1] or got[0] != shapes["prompt_embeds"][0]:
                    wanted = ", ".join(map(str, want)).replace("B", str(shapes["prompt_embeds"][0]))
                    raise ValueError(f"{key} has shape {tuple(got)}; this model takes [{wanted}]")
        negatives = [k for k in ("negative_prompt_embeds", "negative_pooled_prompt_embeds") if k in shapes]
        if len(negatives) == 1:
            raise ValueError(f"the embeddings file has {negatives[0]} without its pair: give both negatives")
        if negatives and shapes["negative_prompt_embeds"] != shapes["prompt_embeds"]:
            raise ValueError(
                f"negative_prompt_embeds {tuple(shapes['negative_prompt_embeds'])} differ from prompt_embeds "
                f"{tuple(shapes['prompt_embeds'])}"
            )

    def guidance_scale_ignored(self, config: flux.FluxConfig, label: str) -> str | None:
        """FLUX.1's ``guidance_scale`` is the distilled guidance embedding's input: a model without that
        embedding (FLUX.1-schnell, tiny-digits) ignores it."""
        if config.guidance_embed:
            return None
        return (
            f"--guidance_scale feeds FLUX.1-dev's guidance embedding; {label} has none (like "
            "FLUX.1-schnell), so it would change nothing: for classifier-free guidance give "
            "--true_cfg_scale and --negative_prompt"
        )

    def check_pipefusion(self, request: Any, config: flux.FluxConfig, parallel: Any, multiple: int) -> None:
        """M >= P patches of whole rows of packed tokens that ring x ulysses splits; 1 <= warm-up <= steps."""
        rows, cols = request.height // multiple, request.width // multiple
        patches = request.num_pipeline_patch
        if patches is None:
            patches = default_num_patches(parallel.pipefusion, rows)
        validate_pipefusion(
            parallel.pipefusion,
            patches,
            1 if request.warmup_steps is None else request.warmup_steps,
            request.num_inference_steps,
        )
        validate_patches(rows, cols, patches, parallel.sequence_degree)

    def wrap(self, model: nnx.Module, mesh: Mesh, **options: Any) -> FluxForward:
        return FluxForward(model, mesh, **options)

    def output_features(self, config: flux.FluxConfig) -> int:
        return config.out_channels

    def step_terms(self, w: Any, parallel: Any, sh: Any) -> StepTerms:
        """FLUX's blocks (``models/flux.py``): double blocks run q/k/v/out and the MLP on both streams with
        their own 6E modulations; single blocks one 3E modulation, q/k/v + MLP-in and one linear2 whose
        [attention | MLP] partial sums share one all-reduce. Embedders and the final layer replicated."""
        m, e, d, b, n = w.model, w.hidden, w.head_dim, sh.b, sh.n
        n_txt, n_img = sh.local
        vec = 2 * b * (FREQ_DIM * e + e * e) + 2 * b * (m.vec_in_dim * e + e * e)  # time_in, vector_in
        if m.guidance_embed:
            vec += 2 * b * (FREQ_DIM * e + e * e)
        nonblock = (
            vec
            + 2 * b * n_img * m.in_channels * e  # img_in
            + 2 * b * n_txt * m.context_in_dim * e  # txt_in
            + 2 * b * e * 2 * e  # final adaLN (replicated)
            + 2 * b * n_img * e * m.out_channels  # final linear
        )
        qkv_proj = 2 * b * n * e * sh.e_t * 4  # q, k, v, out projections (txt and img streams together)
        mlp = 2 * b * n * e * sh.f_t * 2
        att = sh.self_attention_flops
        double = 2 * (2 * b * e * 6 * e) + qkv_proj + mlp + att  # two streams' 6E modulation, replicated
        single = 2 * b * e * 3 * e + qkv_proj + mlp + att  # mlp_in, linear2's MLP half

        e_t, f_t = sh.e_t, sh.f_t
        embed = lambda d_in: d_in * e + e + e * e + e  # MLPEmbedder: Linear(d_in, E) -> Linear(E, E)
        param_nonblock = (
            m.in_channels * e
            + e
            + m.context_in_dim * e
            + e
            + embed(FREQ_DIM)
            + embed(m.vec_in_dim)
            + (embed(FREQ_DIM) if m.guidance_embed else 0)
            + e * 2 * e
            + 2 * e  # final adaLN
            + e * m.out_channels
            + m.out_channels
        )
        # Column-parallel q/k/v (+bias) and MLP-in (+bias), row-parallel out projections (bias replicated);
        # modulation and QK-norm scales replicated.
        qkv = 3 * (e * e_t + e_t) + 2 * d
        stream = (e * 6 * e + 6 * e) + qkv + (e_t * e + e) + (e * f_t + f_t) + (f_t * e + e)
        single_params = (e * 3 * e + 3 * e) + qkv + (e * f_t + f_t) + (e_t * e + e) + f_t * e
        a = w.itemsize
        reductions = (
            Reduction(
                "double blocks, text stream: attention-out and MLP-down partial sums", 0, 2, b * n_txt * e
            ),
            Reduction(
                "double blocks, image stream: attention-out and MLP-down partial sums", 0, 2, b * n_img * e
            ),
            Reduction("single blocks: linear2 partial sums ([attention | MLP] in one)", 1, 1, b * n * e),
        )
        return StepTerms(
            nonblock_flops=nonblock,
            block_flops=(double, single),
            attention_flops=att,
            param_nonblock_bytes=param_nonblock * a,
            param_block_bytes=(2 * stream * a, single_params * a),
            reductions=reductions,
        )

    def workload_shape(self, config, height, width, frames, text_tokens):
        if frames != 1:
            raise ValueError(f"FLUX makes images: frames must be 1, got {frames}")
        image = (height // PIXELS_PER_TOKEN) * (width // PIXELS_PER_TOKEN)
        return (TEXT_LEN if text_tokens is None else text_tokens, image), ()


FLUX = FluxFamily()
