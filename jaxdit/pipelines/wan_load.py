"""Building a ``WanPipeline`` from files: a checkpoint (one transformer or Wan 2.2 A14B's two experts) or
a downloaded folder with its encoders, VAE and scheduler.

Wan 2.2's two experts are checked (heads against the mesh, key tables against their file headers,
``pipelines/assemble.py``) and compared with each other before any weight is read; the low-noise expert
is read first and, with ``offload_idle_expert``, moved to host memory before the high-noise one is read,
so the devices never hold both. The functions return the pipeline constructor's arguments;
``WanPipeline.from_checkpoint`` / ``from_pretrained`` (``pipelines/wan.py``) build it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from converters.wan import CHECKPOINTS
from jaxdit.loading.wan import load_wan_image_encoder, load_wan_text_encoder, load_wan_vae
from jaxdit.mesh import DeviceMesh, MeshLike, ParallelConfig
from jaxdit.models.wan_config import WanConfig
from jaxdit.parallel.kernels import check_kernel_options, with_backend
from jaxdit.pipelines.assemble import as_dtype, check_transformer, load_model, preset_check
from jaxdit.pipelines.pipefusion.wan import PipeFusionWan
from jaxdit.pipelines.wan_experts import to_host
from jaxdit.pipelines.wan_folder import WanVariant, open_folder
from jaxdit.pipelines.wan_image import FirstFrameLatent, ImageCondition
from jaxdit.samplers import unipc

__all__ = ["checkpoint_arguments", "config_difference", "folder_arguments"]

#: What the builders return: the pipeline's model and mesh, and its other constructor arguments.
Arguments = tuple[Any, DeviceMesh, dict[str, Any]]


def checkpoint_arguments(
    path: str | os.PathLike[str],
    paths: Sequence[Path],
    variant: WanVariant,
    parallel: ParallelConfig | Mesh | None,
    dtype: Any,
    *,
    preset: str | None,
    offload_idle_expert: bool,
    kernel: dict[str, Any] | None,
    attention_backend: str | None,
) -> Arguments:
    """A checkpoint's transformer(s) on the mesh: ``paths`` are its experts' files
    (``wan_folder.checkpoint_experts``), ``variant`` the Wan 2.2 settings it carries."""
    kernel = with_backend(kernel, attention_backend)
    check_kernel_options(kernel)
    mesh = DeviceMesh.of(parallel)
    check = preset_check(path, CHECKPOINTS, preset)
    second = None
    if len(paths) == 2:
        _check_experts(paths, mesh)
        second = _load_second(paths[1], mesh, dtype, check, offload_idle_expert)
    elif offload_idle_expert:
        raise ValueError(f"offload_idle_expert applies to two-expert checkpoints; {path} holds one")
    model = load_model(paths[0], mesh, dtype, CHECKPOINTS, check, staged=PipeFusionWan)
    options = dict(
        transformer_2=second,
        boundary_ratio=variant.boundary_ratio,
        expand_timesteps=variant.expand_timesteps,
        offload_idle_expert=offload_idle_expert,
        kernel=kernel,
    )
    return model, mesh, options


def folder_arguments(
    path: str | os.PathLike[str],
    parallel: ParallelConfig | Mesh | None,
    dtype: Any,
    *,
    encoder_device: jax.Device | None,
    vae_dtype: Any,
    offload_idle_expert: bool,
    kernel: dict[str, Any] | None,
    compiler_options: dict[str, Any] | None,
    attention_backend: str | None,
    fp8: str | None = None,
    offload_encoders: bool = False,
) -> Arguments:
    """A downloaded Wan folder's transformer(s) on the mesh, with its text encoder, VAE (decode, and the
    image conditioning of I2V / TI2V), scheduler settings and Wan 2.2 variant."""
    kernel = with_backend(kernel, attention_backend)
    check_kernel_options(kernel)
    folder = open_folder(path)
    variant = WanVariant.of(folder)
    where = DeviceMesh.of(parallel)
    mesh = where.mesh  # the VAE's
    experts = tuple(folder[c] for c in ("transformer", "transformer_2") if c in folder)
    config = _check_experts(experts, where)
    if offload_idle_expert and len(experts) == 1:
        raise ValueError(f"offload_idle_expert applies to two-expert folders (Wan 2.2 A14B); {path} has one")
    dtype = as_dtype(dtype)
    text = load_wan_text_encoder(
        folder.root,
        dtype=dtype,
        device=encoder_device,
        compiler_options=compiler_options,
        offload=offload_encoders,
    )
    vae = load_wan_vae(folder["vae"], dtype=as_dtype(vae_dtype), compiler_options=compiler_options)
    factors = dict(temporal=vae.config.temporal_factor, spatial=vae.config.spatial_factor)
    encode_image = None
    if "image_encoder" in folder:
        image_encoder = load_wan_image_encoder(
            folder.root,
            dtype=dtype,
            device=encoder_device,
            compiler_options=compiler_options,
            offload=offload_encoders,
        )
        encode_image = ImageCondition(image_encoder, vae, mesh=mesh, **factors)
    elif config.condition_channels:
        encode_image = ImageCondition(None, vae, mesh=mesh, **factors)  # Wan 2.2 I2V-A14B: no CLIP
    elif variant.expand_timesteps:
        encode_image = FirstFrameLatent(vae, mesh=mesh)
    second = None
    if len(experts) == 2:
        if fp8 is not None:
            raise ValueError(f"FP8 weights load one-expert Wan folders; {path} holds two (Wan 2.2 A14B)")
        second = _load_second(experts[1], where, dtype, None, offload_idle_expert)
    model = load_model(experts[0], where, dtype, CHECKPOINTS, staged=PipeFusionWan, fp8=fp8)

    def decode(z: np.ndarray) -> np.ndarray:
        video = np.asarray(vae.decode_latents(z, mesh=mesh))  # [B, 3, F, H, W]
        return video.transpose(0, 2, 3, 4, 1)  # the pipeline's frames [B, F, H, W, 3]

    scheduler = unipc.UniPCConfig.from_diffusers(folder.scheduler_config) if folder.scheduler_config else None
    options = dict(
        transformer_2=second,
        boundary_ratio=variant.boundary_ratio,
        expand_timesteps=variant.expand_timesteps,
        offload_idle_expert=offload_idle_expert,
        scheduler=scheduler,
        encode=text,
        decode=decode,
        encode_image=encode_image,
        vae_scale_factor_spatial=factors["spatial"],
        vae_scale_factor_temporal=factors["temporal"],
        kernel=kernel,
        compiler_options=compiler_options,
    )
    return model, where, options


def config_difference(config: WanConfig, other: WanConfig) -> str:
    """Why two experts' configs cannot share one pipeline: the fields where ``other`` differs."""
    diff = [
        f"{f.name}={getattr(other, f.name)} (transformer: {getattr(config, f.name)})"
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(other, f.name)
    ]
    return f"the two Wan experts must share one architecture; transformer_2 has {', '.join(diff)}"


def _check_experts(paths: Sequence[Path], mesh: MeshLike) -> WanConfig:
    """Every expert's config against the mesh and its key table against its files (headers only), and
    the experts' configs against each other: all before any weight is read."""
    configs = [check_transformer(p, mesh, CHECKPOINTS) for p in paths]
    if len(configs) == 2 and configs[0] != configs[1]:
        raise ValueError(f"{paths[1]}: " + config_difference(configs[0], configs[1]))
    return configs[0]


def _load_second(path: Path, mesh: MeshLike, dtype: Any, check: Any, offload: bool) -> nnx.State:
    """The low-noise expert's parameters; with ``offload`` moved to host memory at once, before the
    high-noise expert is read, so the devices never hold both."""
    loaded = load_model(path, mesh, as_dtype(dtype), CHECKPOINTS, check, staged=PipeFusionWan)
    state = loaded.state if isinstance(loaded, PipeFusionWan) else nnx.state(loaded)  # stage layout or plain
    return to_host(state) if offload else state
