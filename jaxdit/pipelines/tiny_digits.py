"""``tiny-digits``: a FLUX-architecture model small enough to ship, trained on scikit-learn's digits.

It exists so that the main job makes real pictures on any machine through exactly the machinery a GPU
cluster uses: the same FLUX transformer code, parallel attention, CFG parallel and samplers. A digit
image is a 1-channel 16x16 "latent" (no VAE), packed into 8x8 = 64 tokens of 4 features. The class label
is the prompt: a learned table turns it into text tokens that enter through FLUX's joint attention (and a
pooled vector), standing in for T5/CLIP. Label 10 is the empty prompt, used for classifier-free guidance
(the training script drops labels to it).

The bundled folder is laid out like a diffusers pipeline folder: ``transformer/`` (``config.json`` +
``diffusion_pytorch_model.safetensors`` with diffusers' key names; its MLP ratio of 2 is a jaxdit config
field, since diffusers' ``FluxTransformer2DModel`` fixes the ratio at 4),
``label_encoder/label_embeddings.safetensors`` and ``training.json`` (how it was trained, what it scored).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from converters.flux import CHECKPOINTS
from jaxdit.mesh import DeviceMesh, ParallelConfig
from jaxdit.models.flux import FluxConfig
from jaxdit.pipelines.assemble import as_dtype, load_model
from jaxdit.pipelines.flux import FluxPipeline
from jaxdit.pipelines.pipefusion.flux import PipeFusionFlux
from jaxdit.samplers import flow_match_euler as euler

NAME = "tiny-digits"
NUM_CLASSES = 10
NULL_LABEL = NUM_CLASSES  # the empty prompt
TEXT_TOKENS = 4
LATENT_CHANNELS = 1
LATENT_SIZE = 16  # pixels = latent (no VAE)

CONFIG = FluxConfig(
    in_channels=4 * LATENT_CHANNELS,
    out_channels=4 * LATENT_CHANNELS,
    vec_in_dim=32,
    context_in_dim=32,
    hidden_size=64,
    num_heads=4,  # ulysses x tensor up to 4 (the demo's cfg2 x ring2 x ulysses2 needs 2)
    depth=2,
    depth_single_blocks=2,
    mlp_ratio=2.0,  # small enough to train in minutes on two CPU cores
    axes_dim=(4, 6, 6),
    guidance_embed=False,  # true CFG with the null label instead
)

TRANSFORMER_DIR = "transformer"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
ENCODER_DIR = "label_encoder"
EMBEDDINGS_FILE = "label_embeddings.safetensors"


def asset_dir() -> Path:
    """Where the bundled checkpoint lives inside the installed package."""
    return Path(str(resources.files("jaxdit") / "assets" / NAME))


def diffusers_config(cfg: FluxConfig) -> dict:
    """A diffusers ``FluxTransformer2DModel`` config.json for ``cfg`` (patch_size 1, packed channels)."""
    return {
        "_class_name": "FluxTransformer2DModel",
        "patch_size": 1,
        "in_channels": cfg.in_channels,
        "out_channels": cfg.out_channels,
        "num_layers": cfg.depth,
        "num_single_layers": cfg.depth_single_blocks,
        "attention_head_dim": cfg.head_dim,
        "num_attention_heads": cfg.num_heads,
        "joint_attention_dim": cfg.context_in_dim,
        "pooled_projection_dim": cfg.vec_in_dim,
        "guidance_embeds": cfg.guidance_embed,
        "axes_dims_rope": list(cfg.axes_dim),
        # Not a diffusers field (diffusers fixes 4.0); jaxdit reads it, so the tiny model can be narrower.
        "mlp_ratio": cfg.mlp_ratio,
    }


class LabelEncoder:
    """The tiny model's "text encoder": label -> (text tokens [T, 32], pooled vector [32])."""

    def __init__(self, tokens: np.ndarray, pooled: np.ndarray) -> None:
        if tokens.shape[0] != NUM_CLASSES + 1 or pooled.shape[0] != NUM_CLASSES + 1:
            raise ValueError(f"label tables have {tokens.shape[0]} rows; expected {NUM_CLASSES + 1}")
        self.tokens = np.asarray(tokens, np.float32)
        self.pooled = np.asarray(pooled, np.float32)

    @classmethod
    def load(cls, folder: str | Path | None = None) -> LabelEncoder:
        from converters.safetensors_io import open_checkpoint

        ckpt = open_checkpoint(Path(folder or asset_dir()) / ENCODER_DIR / EMBEDDINGS_FILE)
        return cls(ckpt.read("tokens"), ckpt.read("pooled"))

    def __call__(self, labels) -> tuple[np.ndarray, np.ndarray]:
        labels = np.asarray(labels, np.int64)
        if labels.min() < 0 or labels.max() > NULL_LABEL:
            raise ValueError(f"digit labels must be 0..9 (10 = empty prompt); got {labels.tolist()}")
        return self.tokens[labels], self.pooled[labels]


def parse_prompt(prompt: str) -> list[int]:
    """ "7", "0123456789", "3 1 4" -> digit labels; "" -> the empty prompt."""
    digits = [c for c in prompt if not c.isspace() and c != ","]
    if not digits:
        return [NULL_LABEL]
    bad = [c for c in digits if c not in "0123456789"]
    if bad:
        raise ValueError(f"the tiny-digits model draws digits: its prompt is digits 0-9, got {prompt!r}")
    return [int(c) for c in digits]


def training_record(folder: str | Path | None = None) -> dict:
    path = Path(folder or asset_dir()) / "training.json"
    return json.loads(path.read_text()) if path.exists() else {}


def tiny_digits(
    parallel: ParallelConfig | Mesh | None = None,
    folder: str | Path | None = None,
    compiler_options: dict[str, Any] | None = None,
    kernel: dict[str, Any] | None = None,
    dtype: Any = None,
    fp8: str | None = None,
) -> FluxPipeline:
    """The bundled ``tiny-digits`` model as a pipeline: prompts are digits ("7", "0123456789").
    ``dtype``: its weights' and activations' type (default float32, as it was trained; bfloat16 runs the
    fused GPU kernels). A PipeFusion mesh gets the PipeFusion pipeline, as every family's does.
    ``fp8``: ``"weight"`` or ``"matmul"``, the blocks' linear layers in FP8 (``jaxdit.models.fp8``)."""
    mesh = DeviceMesh.of(parallel)
    folder = Path(folder or asset_dir())
    dtype = jnp.float32 if dtype is None else as_dtype(dtype)
    model = load_model(folder, mesh, dtype, CHECKPOINTS, staged=PipeFusionFlux, fp8=fp8)
    labels = LabelEncoder.load(folder)

    def encode(prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        return labels([label for p in prompts for label in parse_prompt(p)])

    pipe = FluxPipeline(
        model,
        mesh,
        scheduler=euler.FlowMatchEulerConfig(shift=1.0),
        encode=encode,
        decode=lambda z: z[:, 0],  # pixel space: the 1-channel latent is the image
        latent_channels=LATENT_CHANNELS,
        vae_scale_factor=1,
        kernel=kernel,
        compiler_options=compiler_options,
    )
    pipe.default_size = (LATENT_SIZE, LATENT_SIZE)  # what it was trained on, not FLUX's 1024
    return pipe
