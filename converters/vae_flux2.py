"""FLUX.2's autoencoder checkpoints (diffusers ``AutoencoderKLFlux2``) -> jaxdit's AutoencoderKL
parameters plus the latent BatchNorm statistics.

``AutoencoderKLFlux2`` is diffusers' ``AutoencoderKL`` encoder/decoder (with its quant convs) at 32 latent
channels, plus a non-affine ``bn`` (BatchNorm2d over the 2 x 2-patchified latents, 128 channels) whose
running mean and variance the pipelines use to normalise the transformer's latents. The convolution
tensors go through the AutoencoderKL key table (``converters/vae_kl.py``), strictly; the three ``bn``
buffers are read here, and the table must account for every other key.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import CheckpointError
from converters.keymap import Without
from converters.safetensors_io import open_checkpoint
from converters.vae_kl import VAECheckpoint
from jaxdit.vae.autoencoder_kl import VAEConfig

__all__ = ["DIFFUSERS_CLASS", "Flux2VAECheckpoint", "detect"]

DIFFUSERS_CLASS = "AutoencoderKLFlux2"
BN_KEYS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


@dataclasses.dataclass
class Flux2VAECheckpoint:
    """The AutoencoderKL part (a :class:`VAECheckpoint` without the ``bn`` keys) and the statistics."""

    vae: VAECheckpoint
    running_mean: np.ndarray  # [patch_h * patch_w * latent_channels]
    running_var: np.ndarray
    eps: float
    patch_size: tuple[int, int]
    dtype: np.dtype


def _folder(path: Path) -> Path | None:
    for folder in (path, path / "vae"):
        cfg = folder / "config.json"
        if cfg.is_file():
            try:
                data = json.loads(cfg.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{cfg}: cannot read the config: {e}") from e
            if data.get("_class_name") == DIFFUSERS_CLASS:
                return folder
    return None


def detect(path: str | Path) -> Flux2VAECheckpoint:
    """Open a diffusers ``AutoencoderKLFlux2`` folder (or a pipeline folder holding it in ``vae/``)."""
    path = Path(path)
    folder = _folder(path) if path.is_dir() else None
    if folder is None:
        raise CheckpointError(
            f"{path}: not a FLUX.2 autoencoder (no config.json with _class_name '{DIFFUSERS_CLASS}' here "
            "or in vae/)"
        )
    data: dict[str, Any] = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    decoder_channels = data.get("decoder_block_out_channels")
    if decoder_channels is not None and list(decoder_channels) != list(data.get("block_out_channels", [])):
        raise CheckpointError(
            f"{folder / 'config.json'}: decoder_block_out_channels {decoder_channels} differ from "
            "block_out_channels; that variant is not supported"
        )
    patch = tuple(int(p) for p in data.get("patch_size", (2, 2)))
    try:
        cfg = VAEConfig.from_diffusers(data)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    main = folder / "diffusion_pytorch_model.safetensors"
    files = open_checkpoint(main if main.is_file() else folder)
    missing = [k for k in BN_KEYS[:2] if k not in files]
    if missing:
        raise CheckpointError(f"{folder}: no latent statistics {', '.join(missing)} in the checkpoint")
    stats = {k: np.asarray(files.tensor(k), np.float32) for k in BN_KEYS[:2]}
    channels = patch[0] * patch[1] * cfg.latent_channels
    for key, value in stats.items():
        if value.shape != (channels,):
            raise CheckpointError(
                f"{folder}: {key} has shape {value.shape}, expected ({channels},) for {cfg.latent_channels} "
                f"latent channels in {patch[0]} x {patch[1]} patches"
            )
    return Flux2VAECheckpoint(
        vae=VAECheckpoint(Without(files, set(BN_KEYS)), "diffusers", cfg),
        running_mean=stats["bn.running_mean"],
        running_var=stats["bn.running_var"],
        eps=float(data.get("batch_norm_eps", 1e-4)),
        patch_size=patch,
        dtype=files.dtype("decoder.conv_in.weight"),
    )
