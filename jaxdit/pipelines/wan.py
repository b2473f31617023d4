"""Text-to-video (and image-to-video) sampling with a Wan 2.1 transformer on a mesh.

Mirrors diffusers' ``WanPipeline`` call (pipelines/wan/pipeline_wan.py, diffusers 0.42.1): prompt or prompt
embeddings, a negative prompt for classifier-free guidance ``u + g (c - u)`` (on when ``guidance_scale > 1``),
height, width, num_frames (4n + 1), num_inference_steps, a seed, output_type; the sampler is UniPC on flow
sigmas (:mod:`jaxdit.samplers.unipc`, diffusers' ``UniPCMultistepScheduler(prediction_type="flow_prediction",
use_flow_sigmas=True, flow_shift=...)``), and the devices come from a ``ParallelConfig`` mesh. I2V (as
``WanImageToVideoPipeline``) adds the CLIP image features and the condition latent (4 mask channels, then the
VAE latent of the first frame) that the transformer reads beside the noise.

Data layout. The latent [B, 16, F', H/8, W/8] (F' = (F - 1) / 4 + 1) is patchified into video tokens
[B, N, 64] once, on the host, padded to the mesh's shard-major token layout, and placed with requests over
``data`` and tokens over (``ring``, ``ulysses``) -- logical axes ("request", "seq", None), as FLUX's latents.
The tokens and the UniPC state (three more arrays of the same shape) stay in that layout for the whole
loop: each denoising step is one jitted program (sharded transformer forward, CFG's single exchange of one
prediction, UniPC update) from padded sharded tokens to padded sharded tokens, with no host round trip.
Only after the last step are the tokens gathered, unpadded and unpatchified.

Token features: Wan's patch embedding reads a token's features in (c, t, h, w) order, its head writes them in
(t, h, w, c) order. The tokens keep the input order and the step reorders each token's 64 predicted features
to match (a transpose inside each token's feature vector: no token moves, no device talks to another).

Padding: the padded tokens are zero patches at position (0, 0, 0); attention masks them as keys, so they
never touch a real token, and they are dropped at the end.

The initial noise comes from the seed alone (host, fp32): the same seed gives the same video on every mesh.

Encoders and the VAE plug in as callables, as in ``FluxPipeline``: ``encode(prompts) -> [B, T, 4096]`` (umT5,
zero-padded to 512 tokens as Wan does), ``decode(latents [B, 16, F', h, w]) -> video [B, F, H, W, 3]`` in
[-1, 1], and for I2V ``encode_image(images [B, H, W, 3], num_frames, height, width) -> (image_embeds
[B, 257, 1280], condition [B, 20, F', h, w])``. Until they land, calls take ``prompt_embeds`` /
``negative_prompt_embeds`` (and ``image_embeds`` / ``condition``) and ``output_type="latent"``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdit.mesh import ParallelConfig
from jaxdit.models import wan
from jaxdit.models.sharded_forward import validate_forward
from jaxdit.parallel.cfg import combine_branches, interleave_branches, replicate_branches
from jaxdit.parallel.kernels import with_backend
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.flux import LATENT_AXES, GenerationOutput, _progress
from jaxdit.samplers import unipc
from sharding_rules import logical_to_spec

__all__ = [
    "WanInputs",
    "WanPipeline",
    "check_inputs",
    "checkpoint_config_check",
    "default_flow_shift",
    "swap_features",
]

Encoder = Callable[[Sequence[str]], np.ndarray]
Decoder = Callable[[np.ndarray], np.ndarray]
ImageEncoder = Callable[[np.ndarray, int, int, int], tuple[np.ndarray, np.ndarray]]

Shape = tuple[int, ...]


def default_flow_shift(height: int, width: int) -> float:
    """The flow shift diffusers' Wan 2.1 docs recommend: 5.0 at 720p and above, 3.0 at 480p (and below)."""
    return 5.0 if min(height, width) >= 720 else 3.0


# --------------------------------------------------------------------------------------------------------
# Checks: shapes only, no devices (``jaxdit generate`` runs them before jax starts)
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WanInputs:
    """What a valid request comes to: the latent shape [B, C, F', h, w] and whether CFG runs."""

    latent_shape: Shape
    cfg: bool
    flow_shift: float

    @property
    def batch(self) -> int:
        return self.latent_shape[0]


def _nearest(n: int, step: int, offset: int = 0) -> str:
    below = (n - offset) // step * step + offset
    return f"{below} or {below + step}" if below >= max(offset, 1) else f"{below + step}"


def check_inputs(
    config: wan.WanConfig,
    parallel: ParallelConfig,
    *,
    height: int,
    width: int,
    num_frames: int,
    num_inference_steps: int,
    guidance_scale: float,
    prompt_embeds: Shape,
    negative_prompt_embeds: Shape | None = None,
    image_embeds: Shape | None = None,
    condition: Shape | None = None,
    latents: Shape | None = None,
    flow_shift: float | None = None,
    vae_scale_factor_spatial: int = 8,
    vae_scale_factor_temporal: int = 4,
) -> WanInputs:
    """Raise ``ValueError`` naming the numbers for anything a Wan generation cannot run with.

    Needs only shapes, no devices or weights. diffusers rounds bad sizes and frame counts with a warning;
    here they are errors, so that what runs is what was asked for.
    """
    validate_forward(parallel, config.num_heads)  # heads vs ulysses x tensor, no pipefusion
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    if flow_shift is not None and not flow_shift > 0:
        raise ValueError(f"flow_shift must be > 0, got {flow_shift}")
    pt, ph, pw = config.patch_size
    s, t = vae_scale_factor_spatial, vae_scale_factor_temporal
    for name, size, multiple in (("height", height, s * ph), ("width", width, s * pw)):
        if size < multiple or size % multiple:
            raise ValueError(
                f"{name} {size} must be a positive multiple of {multiple} (VAE factor {s} x patch "
                f"{multiple // s}); nearest: {_nearest(size, multiple)}"
            )
    if num_frames < 1 or (num_frames - 1) % t:
        raise ValueError(
            f"num_frames {num_frames} must be {t}n + 1 (the VAE keeps the first frame and folds every {t} "
            f"after it into one latent frame); nearest: {_nearest(num_frames, t, 1)}"
        )
    frames = (num_frames - 1) // t + 1
    if frames % pt:
        raise ValueError(f"{frames} latent frames are not a multiple of the temporal patch {pt}")

    if len(prompt_embeds) != 3 or min(prompt_embeds) < 1 or prompt_embeds[2] != config.text_dim:
        raise ValueError(
            f"prompt_embeds has shape {tuple(prompt_embeds)}; expected [B, T, {config.text_dim}]"
        )
    batch = prompt_embeds[0]
    if batch % parallel.data:
        raise ValueError(f"{batch} videos cannot be split over data={parallel.data}")
    cfg = guidance_scale > 1.0
    if cfg and negative_prompt_embeds is None:
        raise ValueError(
            f"guidance_scale {guidance_scale} > 1 runs classifier-free guidance, which needs negative "
            "conditioning: pass negative_prompt_embeds (Wan's default negative is the encoded empty prompt), "
            "or guidance_scale=1 for no guidance"
        )
    if cfg and tuple(negative_prompt_embeds) != tuple(prompt_embeds):
        raise ValueError(
            f"negative_prompt_embeds {tuple(negative_prompt_embeds)} differ from prompt_embeds "
            f"{tuple(prompt_embeds)}; both branches run in one batch (Wan pads both to 512 tokens)"
        )
    if parallel.cfg == 2 and not cfg:
        raise ValueError(
            f"cfg=2 (--use_cfg_parallel) puts the conditional and unconditional branches on two devices, but "
            f"guidance_scale {guidance_scale} <= 1 runs no guidance; use guidance_scale > 1 with negative "
            "conditioning, or put the devices on ulysses/ring instead"
        )

    latent = (batch, config.out_channels, frames, height // s, width // s)
    if latents is not None and tuple(latents) != latent:
        raise ValueError(f"latents have shape {tuple(latents)}; this request needs {latent}")
    extra = config.in_channels - config.out_channels
    if config.is_i2v:
        if image_embeds is None or condition is None:
            raise ValueError(
                "an I2V model needs image_embeds (CLIP features [B, 257, 1280]) and condition (mask + VAE "
                f"latent of the first frame, [B, {extra}, F', H/8, W/8])"
            )
        if len(image_embeds) != 3 or image_embeds[0] != batch or image_embeds[2] != config.image_dim:
            raise ValueError(
                f"image_embeds has shape {tuple(image_embeds)}; expected [{batch}, I, {config.image_dim}]"
            )
        want = (batch, extra, *latent[2:])
        if tuple(condition) != want:
            raise ValueError(f"condition has shape {tuple(condition)}; this request needs {want}")
    else:
        if image_embeds is not None or condition is not None:
            raise ValueError("image_embeds / condition are for I2V models; this is a text-to-video model")
        if extra:
            raise ValueError(
                f"in_channels {config.in_channels} != out_channels {config.out_channels} without image input"
            )
    shift = flow_shift if flow_shift is not None else default_flow_shift(height, width)
    return WanInputs(latent_shape=latent, cfg=cfg, flow_shift=shift)


def checkpoint_config_check(path: Any, preset: str | None = None) -> Callable[[Any], None]:
    """A check of a checkpoint's config before any weight is read: it must be Wan 2.1's and, with
    ``preset`` (e.g. ``"wan2.1-t2v-14b"``), that preset's; the message names the fields that differ.

    The preset is looked up here, so an unknown name fails before the checkpoint is opened.
    """
    expected = wan.WanConfig.preset(preset) if preset is not None else None

    def check(config: Any) -> None:
        if not isinstance(config, wan.WanConfig):
            raise ValueError(f"{path} is a {type(config).__name__} checkpoint, not Wan 2.1")
        if expected is not None and config != expected:
            diff = [
                f"{f.name}={getattr(config, f.name)} (preset: {getattr(expected, f.name)})"
                for f in dataclasses.fields(config)
                if getattr(config, f.name) != getattr(expected, f.name)
            ]
            raise ValueError(f"{path} is not {preset}: {', '.join(diff)}")

    return check


# --------------------------------------------------------------------------------------------------------
# Token features
# --------------------------------------------------------------------------------------------------------


def swap_features(tokens: Any, outer: int, inner: int) -> Any:
    """[..., outer * inner] -> [..., inner * outer]: swap the two factors of each token's feature index.

    (patch, channel) -> (channel, patch) turns the head's (t, h, w, c) features into the patch embedding's
    (c, t, h, w) order, and back. numpy or jax; only each token's own features move.
    """
    x = tokens.reshape(*tokens.shape[:-1], outer, inner)
    return x.swapaxes(-1, -2).reshape(*tokens.shape[:-1], outer * inner)


# --------------------------------------------------------------------------------------------------------
# Pipeline
# --------------------------------------------------------------------------------------------------------


class _Loop(NamedTuple):
    """A prepared generation: ``step(params, x, sampler, schedule, context, scale) -> (x, sampler)`` and
    its first arguments (placed), the token layout and the latent token grid."""

    step: Callable
    args: tuple
    layout: SequenceLayout
    grid: tuple[int, int, int]


class WanPipeline:
    """A Wan 2.1 transformer on a mesh plus UniPC, optional text/image encoders and VAE decoder.

    Args:
      model: a ``WanTransformer`` whose parameters are placed for ``mesh`` (``jaxdit.loading.load_params``,
        or :meth:`from_checkpoint`).
      mesh: from ``ParallelConfig.make_mesh``.
      scheduler: UniPC settings; its ``flow_shift`` is used when a call gives none (default: by resolution,
        :func:`default_flow_shift`).
      vae_scale_factor_spatial / vae_scale_factor_temporal: Wan's VAE: 8 and 4.
      kernel: attention tile sizes; compiler_options: XLA options for the compiled step.
    """

    def __init__(
        self,
        model: wan.WanTransformer,
        mesh: Mesh,
        *,
        scheduler: unipc.UniPCConfig | None = None,
        encode: Encoder | None = None,
        decode: Decoder | None = None,
        encode_image: ImageEncoder | None = None,
        vae_scale_factor_spatial: int = 8,
        vae_scale_factor_temporal: int = 4,
        kernel: dict[str, int] | None = None,
        compiler_options: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.config: wan.WanConfig = model.config
        self.mesh = mesh
        self.parallel = ParallelConfig.from_mesh(mesh)
        self.compiler_options = compiler_options
        # XLA options belong to the outermost jit (the step below); jax rejects them on a nested one.
        self.forward = wan.sharded(model, mesh, kernel=kernel)
        self.scheduler = scheduler
        self.encode = encode
        self.decode = decode
        self.encode_image = encode_image
        self.vae_scale_factor_spatial = vae_scale_factor_spatial
        self.vae_scale_factor_temporal = vae_scale_factor_temporal
        self.latent_sharding = NamedSharding(mesh, logical_to_spec(LATENT_AXES, self.forward.rules))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._steps: dict[tuple, Callable] = {}

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        parallel: ParallelConfig | Mesh | None = None,
        dtype: Any = None,
        *,
        preset: str | None = None,
        kernel: dict[str, int] | None = None,
        compiler_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> WanPipeline:
        """Load a Wan checkpoint (diffusers, original or ``jaxdit convert`` folder) onto a mesh.

        ``preset`` (e.g. ``"wan2.1-t2v-14b"``): the checkpoint must be that architecture; checked, like the
        heads against the mesh, before any weight is read.
        """
        from jaxdit.loading import _mesh, load_params

        mesh = _mesh(parallel)
        check_config = checkpoint_config_check(path, preset)

        def check(config: Any) -> None:
            check_config(config)
            validate_forward(ParallelConfig.from_mesh(mesh), config.num_heads)

        _, model = load_params(path, mesh, dtype, check=check)
        return cls(model, mesh, kernel=kernel, compiler_options=compiler_options, **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        parallel: ParallelConfig | Mesh | None = None,
        dtype: Any = None,
        *,
        encoder_device: jax.Device | None = None,
        vae_dtype: Any = jnp.float32,
        kernel: dict[str, int] | None = None,
        compiler_options: dict[str, Any] | None = None,
        attention_backend: str | None = None,
    ) -> WanPipeline:
        """A downloaded Wan 2.1 folder -- diffusers ``WanPipeline`` / ``WanImageToVideoPipeline`` layout or
        Wan's original T2V release -- with its umT5 text encoder, VAE (and CLIP image encoder for I2V).

        The transformer is sharded over the mesh; the encoders run on ``encoder_device`` (default: the first
        local device); the VAE decodes patch-parallel over the mesh, in ``vae_dtype`` (fp32 by default, as
        Wan keeps it). See :mod:`jaxdit.pipelines.assemble`. ``attention_backend``: auto, xla, cudnn, triton or
        splash (``jaxdit.parallel.kernels``).
        """
        from jaxdit.pipelines.assemble import wan_pipeline

        return wan_pipeline(
            path,
            parallel,
            dtype,
            encoder_device=encoder_device,
            vae_dtype=vae_dtype,
            kernel=with_backend(kernel, attention_backend),
            compiler_options=compiler_options,
        )

    # ------------------------------------------------------------------ step
    def _step_fn(self, layout, names: tuple[str, ...], cfg: bool, i2v: bool) -> Callable:
        key = (layout, names, cfg, i2v)
        if key in self._steps:
            return self._steps[key]
        forward = self.forward.step(layout, names)
        mesh, dtype = self.mesh, self.model.dtype
        patch, channels = math.prod(self.config.patch_size), self.config.out_channels

        def step(params, x, sampler, schedule, context, scale):
            # x [B, N_pad, C*P] fp32 tokens; sampler: UniPC state like x; context: placed conditioning.
            tokens = jnp.concatenate([x, context["condition"]], axis=-1) if i2v else x
            model_x = replicate_branches(tokens, mesh, seq_sharded=True) if cfg else tokens
            t = schedule.timesteps[sampler.step_index].astype(jnp.float32)
            inputs = dict(
                context,
                hidden_states=model_x.astype(dtype),
                timestep=jnp.full((model_x.shape[0],), t, jnp.float32),
            )
            v = forward(params, *(inputs[n] for n in names))
            if cfg:
                v = combine_branches(v, scale, mesh, seq_sharded=True)
            v = swap_features(v, patch, channels)  # head order (p, c) -> token order (c, p)
            return unipc.step(schedule, sampler, x, v)

        self._steps[key] = jax.jit(
            step,
            out_shardings=(self.latent_sharding, self._state_shardings()),
            donate_argnums=(1, 2),
            compiler_options=self.compiler_options,
        )
        return self._steps[key]

    # ------------------------------------------------------------------ call
    def __call__(
        self,
        prompt: str | Sequence[str] | None = None,
        negative_prompt: str | Sequence[str] | None = None,
        *,
        prompt_embeds: np.ndarray | None = None,
        negative_prompt_embeds: np.ndarray | None = None,
        image: np.ndarray | None = None,
        image_embeds: np.ndarray | None = None,
        condition: np.ndarray | None = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        flow_shift: float | None = None,
        seed: int = 0,
        latents: np.ndarray | None = None,
        max_sequence_length: int | None = None,
        output_type: str = "np",
        progress: bool = True,
    ) -> GenerationOutput:
        """Generate videos; returns latents [B, 16, F', H/8, W/8] and, decoded, ``images`` = video frames
        [B, F, H, W, 3] in [-1, 1].

        ``guidance_scale`` > 1 runs classifier-free guidance against the negative conditioning (with a text
        encoder, ``negative_prompt`` defaults to "" as in diffusers). ``flow_shift``: UniPC's sigma shift
        (default: the scheduler's, else 5.0 at 720p / 3.0 at 480p). ``latents``: initial noise instead of
        the seed's. I2V: ``image`` (with an image encoder) or ``image_embeds`` and ``condition``.
        ``max_sequence_length``: the text encoder's token count (default: the encoder's, 512 for umT5).
        """
        if output_type not in ("np", "latent"):
            raise ValueError(f"output_type must be 'np' or 'latent', got {output_type!r}")
        if output_type == "np" and self.decode is None:
            raise ValueError("this pipeline has no decoder (VAE): use output_type='latent'")
        loop = self._prepare(
            prompt,
            negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            image=image,
            image_embeds=image_embeds,
            condition=condition,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            flow_shift=flow_shift,
            seed=seed,
            latents=latents,
            max_sequence_length=max_sequence_length,
        )
        x, sampler, *rest = loop.args
        start = time.perf_counter()
        for _ in _progress(range(num_inference_steps), progress, num_inference_steps):
            x, sampler = loop.step(self.forward.state, x, sampler, *rest)
        x = np.asarray(jax.device_get(x))
        seconds = time.perf_counter() - start

        mc = self.config
        tokens = swap_features(loop.layout.unpad(x, 0, axis=1), mc.out_channels, math.prod(mc.patch_size))
        out = np.asarray(wan.unpatchify(tokens, loop.grid, mc.patch_size, mc.out_channels))
        video = self.decode(out) if output_type == "np" else None
        return GenerationOutput(images=video, latents=out, seconds=seconds)

    def lower_step(self, **kwargs: Any) -> jax.stages.Lowered:
        """The compiled denoising step of a call with these keyword arguments (as ``__call__``'s), lowered
        on its real placed inputs: for reading its collectives (``jaxdit.hlo_stats``) and memory."""
        loop = self._prepare(**kwargs)
        return loop.step.lower(self.forward.state, *loop.args)

    def _prepare(
        self,
        prompt: str | Sequence[str] | None = None,
        negative_prompt: str | Sequence[str] | None = None,
        *,
        prompt_embeds: np.ndarray | None = None,
        negative_prompt_embeds: np.ndarray | None = None,
        image: np.ndarray | None = None,
        image_embeds: np.ndarray | None = None,
        condition: np.ndarray | None = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        flow_shift: float | None = None,
        seed: int = 0,
        latents: np.ndarray | None = None,
        max_sequence_length: int | None = None,
    ) -> _Loop:
        """Everything before the loop: conditioning, checks, noise, tokens placed once, the step."""
        txt = self._embed(prompt, prompt_embeds, "prompt", max_sequence_length=max_sequence_length)
        neg = None
        if guidance_scale > 1.0:
            if negative_prompt is None and negative_prompt_embeds is None and self.encode is not None:
                negative_prompt = ""  # diffusers' default negative prompt
            neg = self._embed(
                negative_prompt,
                negative_prompt_embeds,
                "negative_prompt",
                batch=len(txt),
                max_sequence_length=max_sequence_length,
            )
        if image is not None:
            if image_embeds is not None or condition is not None:
                raise ValueError("pass either an image or image_embeds and condition, not both")
            if self.encode_image is None:
                raise ValueError("this pipeline has no image encoder: pass image_embeds and condition")
            image_embeds, condition = self.encode_image(np.asarray(image), num_frames, height, width)
        if flow_shift is None and self.scheduler is not None:
            flow_shift = self.scheduler.flow_shift
        plan = check_inputs(
            self.config,
            self.parallel,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            prompt_embeds=txt.shape,
            negative_prompt_embeds=None if neg is None else neg.shape,
            image_embeds=None if image_embeds is None else np.shape(image_embeds),
            condition=None if condition is None else np.shape(condition),
            latents=None if latents is None else np.shape(latents),
            flow_shift=flow_shift,
            vae_scale_factor_spatial=self.vae_scale_factor_spatial,
            vae_scale_factor_temporal=self.vae_scale_factor_temporal,
        )
        cfg, data = plan.cfg, self.parallel.data
        rows = plan.batch * (2 if cfg else 1)

        # Tokens, positions and conditioning on the host, padded, then placed once for the whole loop.
        mc = self.config
        noise = latent_ops.initial_noise(seed, plan.latent_shape) if latents is None else latents
        grid = wan.latent_grid(plan.latent_shape, mc.patch_size)
        tokens = wan.patchify(np.asarray(noise, np.float32), mc.patch_size)
        if cfg:
            txt = np.asarray(interleave_branches(neg, txt, data))
        context = {"positions": wan.token_positions(grid), "encoder_hidden_states": txt}
        if mc.is_i2v:
            # Both branches see the same image; only the text differs (as in diffusers).
            img = np.asarray(image_embeds, np.float32)
            context["encoder_hidden_states_image"] = (
                np.asarray(interleave_branches(img, img, data)) if cfg else img
            )
        shapes = {n: np.shape(v) for n, v in context.items()}
        shapes["hidden_states"] = (rows, tokens.shape[1], mc.patch_features)
        shapes["timestep"] = (rows,)
        layout = self.forward.layout(shapes)  # batch vs data x cfg, before compiling
        names = tuple(n for n in wan.FORWARD_INPUTS if n in shapes)

        placed = {}
        for name, value in context.items():
            arg = wan.FORWARD_INPUTS[name]
            if arg.group is not None:
                value = layout.pad(value, arg.group, axis=arg.seq_axis)
            placed[name] = jax.device_put(value, self.forward.sharding(arg))
            if name != "positions":
                placed[name] = placed[name].astype(self.model.dtype)
        if mc.is_i2v:
            cond_tokens = wan.patchify(np.asarray(condition, np.float32), mc.patch_size)
            placed["condition"] = jax.device_put(layout.pad(cond_tokens, 0, axis=1), self.latent_sharding)
        x = jax.device_put(layout.pad(tokens, 0, axis=1), self.latent_sharding)
        sampler = jax.jit(unipc.init_state, out_shardings=self._state_shardings())(x)

        scheduler = dataclasses.replace(self.scheduler or unipc.UniPCConfig(), flow_shift=plan.flow_shift)
        schedule = jax.device_put(unipc.set_timesteps(scheduler, num_inference_steps), self._replicated)
        step = self._step_fn(layout, names, cfg, mc.is_i2v)
        scale = jax.device_put(np.float32(guidance_scale), self._replicated)
        return _Loop(step, (x, sampler, schedule, placed, scale), layout, grid)

    def _state_shardings(self) -> unipc.UniPCState:
        # The step index is a replicated scalar; the three buffers lie exactly like the tokens.
        return unipc.UniPCState(
            self._replicated, self.latent_sharding, self.latent_sharding, self.latent_sharding
        )

    def _embed(
        self, prompt, embeds, name: str, batch: int | None = None, max_sequence_length: int | None = None
    ) -> np.ndarray:
        if prompt is not None:
            if embeds is not None:
                raise ValueError(f"pass either {name} or {name}_embeds, not both")
            if self.encode is None:
                raise ValueError(f"this pipeline has no text encoder: pass {name}_embeds [B, T, 4096]")
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            if batch is not None and len(prompts) == 1:
                prompts = prompts * batch
            options = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
            embeds = self.encode(prompts, **options)
        if embeds is None:
            if name == "negative_prompt":
                return None  # check_inputs says what is missing
            raise ValueError(f"pass a {name} or {name}_embeds [B, T, {self.config.text_dim}]")
        return np.asarray(embeds, np.float32)
