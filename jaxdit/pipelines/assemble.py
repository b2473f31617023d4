"""A downloaded model folder -> a ready pipeline: transformer on the mesh, encoders and VAE beside it.

Placement, and why:

- The transformer is sharded over the mesh as ``parallel`` says (the only part that runs every step).
- The text encoders (and Wan I2V's image encoder) run once per prompt, on one device of the caller's
  choosing (``encoder_device``; default: the first local device). They are separate jitted programs, not
  part of the mesh's step, so they never make the transformer wait, and on a host with a spare card they
  can live there entirely (the chapter's "text encoder on a card of its own").
- The VAE decodes patch-parallel over all of the mesh's devices (rows split, halo rows exchanged), so its
  activation memory per device falls with the device count; 720p video is decodable this way.

Everything that can be wrong with the folder or with the mesh (missing components, heads the degrees do
not split) is reported before any weight is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines.model_folder import FLUX, WAN_I2V, ModelFolder, open_model_folder

__all__ = ["flux_pipeline", "wan_pipeline"]


def _transformer_config(folder: ModelFolder, mesh: Mesh) -> Any:
    """The transformer's config, checked against the mesh, and its key table checked against the
    checkpoint's tensor names and shapes -- from the config and file headers only, so a broken transformer
    checkpoint is reported before the (large) text encoders are read."""
    from flax import nnx

    from jaxdit.loading import _path, detect_family
    from jaxdit.models.sharded_forward import validate_forward

    path = Path(folder["transformer"])
    family = detect_family(path)
    source = family.open(path, None)
    validate_forward(ParallelConfig.from_mesh(mesh), source.config.num_heads)
    abstract = nnx.state(family.abstract_model(source.config, jnp.float32))
    source.resolve({_path(p): tuple(v.shape) for p, v in nnx.to_flat_state(abstract)})  # strict: names keys
    return source.config


def _dtype(dtype: Any) -> Any:
    return None if dtype is None else jnp.dtype(dtype)


def flux_pipeline(
    path: str | Path,
    parallel: ParallelConfig | Mesh | None = None,
    dtype: Any = None,
    *,
    encoder_device: jax.Device | None = None,
    kernel: dict[str, int] | None = None,
    compiler_options: dict[str, Any] | None = None,
):
    """A FLUX.1 diffusers pipeline folder as a :class:`jaxdit.pipelines.flux.FluxPipeline`."""
    from jaxdit.loading import _mesh, load_params
    from jaxdit.pipelines.flux import FluxPipeline
    from jaxdit.samplers.flow_match_euler import FlowMatchEulerConfig
    from jaxdit.text_encoders import FluxTextEncoders
    from jaxdit.vae.autoencoder_kl import FluxVAE

    folder = open_model_folder(path)
    if folder.kind != FLUX:
        raise ValueError(f"{path} is a {folder.kind} folder, not FLUX.1 (use WanPipeline.from_pretrained)")
    mesh = _mesh(parallel)
    config = _transformer_config(folder, mesh)
    scheduler = FlowMatchEulerConfig.from_diffusers(folder.scheduler_config)
    dtype = _dtype(dtype)
    encoders = FluxTextEncoders.from_folder(
        folder.root, dtype=dtype, device=encoder_device, compiler_options=compiler_options
    )
    vae = FluxVAE.from_folder(folder["vae"], dtype=dtype, compiler_options=compiler_options)
    _, model = load_params(folder["transformer"], mesh, dtype)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    return FluxPipeline(
        model,
        mesh,
        scheduler=scheduler,
        encode=encoders,
        decode=lambda z: np.asarray(vae.decode_latents(z, mesh=mesh)),
        latent_channels=config.in_channels // 4,
        vae_scale_factor=factor,
        kernel=kernel,
        compiler_options=compiler_options,
    )


def wan_pipeline(
    path: str | Path,
    parallel: ParallelConfig | Mesh | None = None,
    dtype: Any = None,
    *,
    encoder_device: jax.Device | None = None,
    vae_dtype: Any = jnp.float32,
    kernel: dict[str, int] | None = None,
    compiler_options: dict[str, Any] | None = None,
):
    """A Wan 2.1 folder (diffusers ``WanPipeline`` / ``WanImageToVideoPipeline``, or Wan's original T2V
    release) as a :class:`jaxdit.pipelines.wan.WanPipeline`. The VAE stays in fp32 by default whatever
    ``dtype`` (as Wan's own code and diffusers' Wan examples keep it); ``vae_dtype`` overrides."""
    from jaxdit.loading import _mesh, load_params
    from jaxdit.pipelines.wan import WanPipeline
    from jaxdit.samplers.unipc import UniPCConfig
    from jaxdit.text_encoders import WanTextEncoder
    from jaxdit.vae.wan_vae import WanVAE

    folder = open_model_folder(path)
    if not folder.is_wan:
        raise ValueError(f"{path} is a {folder.kind} folder, not Wan 2.1 (use FluxPipeline.from_pretrained)")
    mesh = _mesh(parallel)
    _transformer_config(folder, mesh)
    scheduler = UniPCConfig.from_diffusers(folder.scheduler_config) if folder.scheduler_config else None
    dtype = _dtype(dtype)
    text = WanTextEncoder.from_folder(
        folder.root, dtype=dtype, device=encoder_device, compiler_options=compiler_options
    )
    vae = WanVAE.from_folder(folder["vae"], dtype=_dtype(vae_dtype), compiler_options=compiler_options)
    encode_image = None
    if folder.kind == WAN_I2V:
        from jaxdit.pipelines.wan_image import ImageCondition
        from jaxdit.text_encoders import WanImageEncoder

        image_encoder = WanImageEncoder.from_folder(
            folder.root, dtype=dtype, device=encoder_device, compiler_options=compiler_options
        )
        encode_image = ImageCondition(image_encoder, vae, mesh=mesh)
    _, model = load_params(folder["transformer"], mesh, dtype)

    def decode(z: np.ndarray) -> np.ndarray:
        video = np.asarray(vae.decode_latents(z, mesh=mesh))  # [B, 3, F, H, W]
        return video.transpose(0, 2, 3, 4, 1)  # the pipeline's frames [B, F, H, W, 3]

    return WanPipeline(
        model,
        mesh,
        scheduler=scheduler,
        encode=text,
        decode=decode,
        encode_image=encode_image,
        kernel=kernel,
        compiler_options=compiler_options,
    )
