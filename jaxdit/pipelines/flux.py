"""Text-to-image sampling with a FLUX-architecture transformer on a mesh.

Mirrors diffusers' ``FluxPipeline`` call (prompt or prompt embeddings, negative prompt for true CFG,
height, width, num_inference_steps, guidance_scale, a seed, output_type), with a ``ParallelConfig``.

One denoising step is one jitted program: the sharded transformer forward, CFG's single exchange, the
Euler update; the latents stay on the devices, padded to the mesh's token layout, for the whole loop, so
no step makes a host round trip. The initial noise comes from the seed alone (host, fp32), so the same
seed gives the same picture on every mesh.

Text encoders and the VAE plug in as callables: ``encode(prompts) -> (tokens [B, T, C], pooled [B, P])``
and ``decode(latents [B, C, h, w]) -> images [B, H, W(, 3)] in [-1, 1]``. Without an encoder the call
takes ``prompt_embeds``; without a decoder ``output_type="latent"`` is the only choice (the bundled
``tiny-digits`` model works in pixel space, so its decoder is the identity).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux
from jaxdit.parallel.cfg import combine_branches, interleave_branches, replicate_branches
from jaxdit.parallel.kernels import with_backend
from jaxdit.pipelines import latents as latent_ops
from jaxdit.samplers import flow_match_euler as euler
from sharding_rules import logical_to_spec

Encoder = Callable[[Sequence[str]], tuple[np.ndarray, np.ndarray]]
Decoder = Callable[[np.ndarray], np.ndarray]

#: Latents and sampler state between steps: requests over data (replicated over cfg), tokens over
#: (ring, ulysses) in the padded shard layout.
LATENT_AXES = ("request", "seq", None)


@dataclasses.dataclass
class GenerationOutput:
    images: np.ndarray | None  # [B, H, W(, C)] in [-1, 1], when decoded
    latents: np.ndarray  # [B, C, h, w]
    seconds: float  # wall time of the denoising loop (compile included on a first call)


def abstract_like(a):
    """A ShapeDtypeStruct with ``a``'s shape, dtype and sharding (to re-lower a step without data)."""
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))


def _progress(iterable, enabled: bool, total: int):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc="denoising", unit="step", leave=False)


class FluxPipeline:
    """A FLUX transformer on a mesh plus a sampler, optional encoder and decoder.

    Args:
      model: a ``FluxTransformer`` whose parameters are placed for ``mesh`` (``jaxdit.loading.load_params``).
      mesh: from ``ParallelConfig.make_mesh``.
      scheduler: flow-matching Euler settings (FLUX-dev: dynamic shift; the tiny model: shift 1).
      latent_channels / vae_scale_factor: latent shape = [channels, H / f, W / f] (FLUX: 16, 8).
    """

    def __init__(
        self,
        model: flux.FluxTransformer,
        mesh: Mesh,
        *,
        scheduler: euler.FlowMatchEulerConfig | None = None,
        encode: Encoder | None = None,
        decode: Decoder | None = None,
        latent_channels: int = 16,
        vae_scale_factor: int = 8,
        kernel: dict[str, int] | None = None,
        compiler_options: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.compiler_options = compiler_options
        self.mesh = mesh
        self.parallel = ParallelConfig.from_mesh(mesh)
        self.forward = flux.sharded(model, mesh, kernel=kernel)
        self.scheduler = scheduler or euler.FlowMatchEulerConfig(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15
        )
        self.encode = encode
        self.decode = decode
        self.latent_channels = latent_channels
        self.vae_scale_factor = vae_scale_factor
        self._steps: dict[tuple, Callable] = {}

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        parallel: ParallelConfig | Mesh | None = None,
        dtype: Any = None,
        *,
        encoder_device: jax.Device | None = None,
        kernel: dict[str, int] | None = None,
        compiler_options: dict[str, Any] | None = None,
        attention_backend: str | None = None,
    ) -> FluxPipeline:
        """A downloaded FLUX.1 diffusers pipeline folder (``model_index.json``, ``transformer/``, ``vae/``,
        ``text_encoder{,_2}/``, ``tokenizer{,_2}/``, ``scheduler/``) on the mesh of ``parallel``.

        The transformer is sharded over the mesh; the text encoders run on ``encoder_device`` (default: the
        first local device); the VAE decodes patch-parallel over the mesh. See :mod:`jaxdit.pipelines.assemble`.
        ``attention_backend``: auto, xla, cudnn, triton or splash (``jaxdit.parallel.kernels``).
        """
        from jaxdit.pipelines.assemble import flux_pipeline

        return flux_pipeline(
            path,
            parallel,
            dtype,
            encoder_device=encoder_device,
            kernel=with_backend(kernel, attention_backend),
            compiler_options=compiler_options,
        )

    # ------------------------------------------------------------ validation
    def _latent_size(self, height: int, width: int) -> tuple[int, int]:
        f = self.vae_scale_factor
        if height % (2 * f) or width % (2 * f):
            raise ValueError(
                f"height and width must be multiples of {2 * f} (VAE factor {f} x 2x2 patches); got {height}x{width}"
            )
        return height // f, width // f

    def _check_cfg(self, true_cfg: bool) -> None:
        if self.parallel.cfg == 2 and not true_cfg:
            raise ValueError(
                "cfg=2 (--use_cfg_parallel) splits the conditional and unconditional branches over two "
                "devices, but this call has no negative conditioning (negative prompt and true_cfg_scale > 1); "
                "pass them, or put the devices on ulysses/ring instead"
            )

    # ------------------------------------------------------------------ step
    def _step_fn(self, layout, names: tuple[str, ...], true_cfg: bool) -> Callable:
        key = (layout, names, true_cfg)
        if key in self._steps:
            return self._steps[key]
        forward = self.forward.step(layout, names)
        mesh = self.mesh
        latent_sharding = NamedSharding(mesh, logical_to_spec(LATENT_AXES, self.forward.rules))

        def step(state, x, cond, sigma, sigma_next, cfg_scale):
            b = x.shape[0]
            t = jnp.full((2 * b if true_cfg else b,), sigma, jnp.float32)
            model_x = replicate_branches(x, mesh, seq_sharded=True) if true_cfg else x
            inputs = dict(cond, hidden_states=model_x.astype(self.model.dtype), timestep=t)
            v = forward(state, *(inputs[n] for n in names))
            if true_cfg:
                v = combine_branches(v, cfg_scale, mesh, seq_sharded=True)
            return euler.step(x, v.astype(jnp.float32), sigma, sigma_next)

        self._steps[key] = jax.jit(
            step, out_shardings=latent_sharding, donate_argnums=(1,), compiler_options=self.compiler_options
        )
        return self._steps[key]

    # ------------------------------------------------------------------ call
    def __call__(
        self,
        prompt: str | Sequence[str] | None = None,
        *,
        prompt_embeds: np.ndarray | None = None,
        pooled_prompt_embeds: np.ndarray | None = None,
        negative_prompt: str | Sequence[str] | None = None,
        negative_prompt_embeds: np.ndarray | None = None,
        negative_pooled_prompt_embeds: np.ndarray | None = None,
        height: int = 1024,
        width: int = 1024,
        num_inference_steps: int = 28,
        guidance_scale: float = 3.5,
        true_cfg_scale: float = 1.0,
        seed: int = 0,
        max_sequence_length: int | None = None,
        output_type: str = "np",
        progress: bool = True,
    ) -> GenerationOutput:
        """Generate images. ``guidance_scale`` feeds FLUX-dev's guidance embedding (ignored by models
        without one); ``true_cfg_scale`` > 1 with negative conditioning runs classifier-free guidance.
        ``max_sequence_length``: T5's token count (default: the text encoder's, 512 for FLUX)."""
        if output_type not in ("np", "latent"):
            raise ValueError(f"output_type must be 'np' or 'latent', got {output_type!r}")
        if output_type == "np" and self.decode is None:
            raise ValueError("this pipeline has no decoder (VAE): use output_type='latent'")
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        txt, pooled = self._conditioning(
            prompt, prompt_embeds, pooled_prompt_embeds, max_sequence_length=max_sequence_length
        )
        has_negative = negative_prompt is not None or negative_prompt_embeds is not None
        true_cfg = has_negative and true_cfg_scale > 1.0
        self._check_cfg(true_cfg)
        if true_cfg:
            neg_txt, neg_pooled = self._conditioning(
                negative_prompt,
                negative_prompt_embeds,
                negative_pooled_prompt_embeds,
                batch=txt.shape[0],
                max_sequence_length=max_sequence_length,
            )
            if neg_txt.shape != txt.shape:
                raise ValueError(
                    f"negative prompt embeddings {neg_txt.shape} differ from the prompt's {txt.shape}"
                )
            txt = np.asarray(interleave_branches(neg_txt, txt, self.parallel.data))
            pooled = np.asarray(interleave_branches(neg_pooled, pooled, self.parallel.data))

        batch = txt.shape[0] // (2 if true_cfg else 1)
        h, w = self._latent_size(height, width)
        if batch % self.parallel.data:
            raise ValueError(f"{batch} images cannot be split over data={self.parallel.data}")
        noise = latent_ops.initial_noise(seed, (batch, self.latent_channels, h, w))
        x = latent_ops.pack(noise)
        img_ids = latent_ops.image_positions(h, w)
        txt_ids = latent_ops.text_positions(txt.shape[1])
        cond = {
            "encoder_hidden_states": txt.astype(np.float32),
            "pooled_projections": pooled.astype(np.float32),
            "img_ids": img_ids,
            "txt_ids": txt_ids,
        }
        if self.model.config.guidance_embed:
            cond["guidance"] = np.full((txt.shape[0],), guidance_scale, np.float32)
        shapes = {n: np.shape(v) for n, v in cond.items()}
        shapes["hidden_states"] = (txt.shape[0], x.shape[1], x.shape[2])
        shapes["timestep"] = (txt.shape[0],)
        layout = self.forward.layout(shapes)  # checks batch, heads, lengths before compiling
        names = tuple(n for n in flux.FORWARD_INPUTS if n in shapes)

        s = self.scheduler
        mu = (
            euler.flux_mu(x.shape[1], s.base_image_seq_len, s.max_image_seq_len, s.base_shift, s.max_shift)
            if s.use_dynamic_shifting
            else None
        )
        schedule = euler.set_timesteps(self.scheduler, sigmas=euler.flux_sigmas(num_inference_steps), mu=mu)
        placed = {}
        for name, value in cond.items():
            arg = flux.FORWARD_INPUTS[name]
            if arg.group is not None:
                value = layout.pad(value, arg.group, axis=arg.seq_axis)
            placed[name] = jax.device_put(value.astype(np.float32), self.forward.sharding(arg))
            if name in ("encoder_hidden_states", "pooled_projections"):
                placed[name] = placed[name].astype(self.model.dtype)
        latent_sharding = NamedSharding(self.mesh, logical_to_spec(LATENT_AXES, self.forward.rules))
        x = jax.device_put(layout.pad(x, flux.IMAGE, axis=1), latent_sharding)
        step = self._step_fn(layout, names, true_cfg)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        sigmas = jax.device_put(np.asarray(schedule.sigmas, np.float32), replicated)
        scale = jax.device_put(np.float32(true_cfg_scale), replicated)

        args = (self.forward.state, x, placed, sigmas[0], sigmas[1], scale)
        #: The last step function and its abstract arguments, to inspect the compiled program.
        self.last_step = (step, jax.tree.map(abstract_like, args))
        start = time.perf_counter()
        for i in _progress(range(num_inference_steps), progress, num_inference_steps):
            x = step(self.forward.state, x, placed, sigmas[i], sigmas[i + 1], scale)
        x = np.asarray(jax.device_get(x))
        seconds = time.perf_counter() - start
        out = latent_ops.unpack(layout.unpad(x, flux.IMAGE, axis=1), h, w)
        images = self.decode(out) if output_type == "np" else None
        return GenerationOutput(images=images, latents=out, seconds=seconds)

    def _conditioning(
        self, prompt, embeds, pooled, batch: int | None = None, max_sequence_length: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        if prompt is not None:
            if embeds is not None:
                raise ValueError("pass either a prompt or prompt embeddings, not both")
            if self.encode is None:
                raise ValueError(
                    "this pipeline has no text encoder: pass prompt_embeds and pooled_prompt_embeds"
                )
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            if batch is not None and len(prompts) == 1:
                prompts = prompts * batch
            options = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
            embeds, pooled = self.encode(prompts, **options)
        if embeds is None or pooled is None:
            raise ValueError("pass a prompt, or both prompt_embeds [B, T, C] and pooled_prompt_embeds [B, P]")
        embeds, pooled = np.asarray(embeds, np.float32), np.asarray(pooled, np.float32)
        if embeds.ndim != 3 or pooled.ndim != 2 or embeds.shape[0] != pooled.shape[0]:
            raise ValueError(
                f"prompt embeddings {embeds.shape} and pooled {pooled.shape} do not match [B,T,C], [B,P]"
            )
        return embeds, pooled


def tiny_digits(
    parallel: ParallelConfig | Mesh | None = None,
    folder=None,
    compiler_options: dict[str, Any] | None = None,
    kernel: dict[str, Any] | None = None,
) -> FluxPipeline:
    """The bundled ``tiny-digits`` model as a pipeline: prompts are digits ("7", "0123456789")."""
    from jaxdit.loading import _mesh, load_params
    from jaxdit.pipelines import tiny_digits as tiny

    mesh = parallel if isinstance(parallel, Mesh) else _mesh(parallel)
    folder = folder or tiny.asset_dir()
    _, model = load_params(folder, mesh, jnp.float32)
    labels = tiny.LabelEncoder.load(folder)

    def encode(prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = [label for p in prompts for label in tiny.parse_prompt(p)]
        return labels(ids)

    return FluxPipeline(
        model,
        mesh,
        scheduler=euler.FlowMatchEulerConfig(shift=1.0),
        encode=encode,
        decode=lambda z: z[:, 0],  # pixel space: the 1-channel latent is the image
        latent_channels=tiny.LATENT_CHANNELS,
        vae_scale_factor=1,
        kernel=kernel,
        compiler_options=compiler_options,
    )
