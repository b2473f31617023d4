"""How Wan's tokens enter and leave the shared denoising loop: the ``TokenHooks`` of a Wan model.

The loop (``pipelines/denoiser.py``) keeps the latent tokens in the patch embedding's feature order
(c, t, h, w) from start to end; Wan's head writes (t, h, w, c), so each prediction's features are swapped
back inside the step (no token moves, no device talks to another). I2V reads the condition channels (4
mask channels, then the VAE latent of the first frame) beside each noise token. Wan 2.2 TI2V-5B's first
frame replaces the first latent frame's tokens of the model input at every step and of the result, as
diffusers' ``WanPipeline`` with ``expand_timesteps`` does (``pipelines/wan/pipeline_wan.py``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdit.models.wan_config import WanConfig
from jaxdit.models.wan_patchify import swap_features, token_positions
from jaxdit.pipelines.denoiser import TokenHooks

__all__ = ["first_frame_tokens", "token_hooks", "with_first_frame"]


def _model_input(x: jax.Array, extras: dict[str, jax.Array]) -> jax.Array:
    """The forward's ``hidden_states`` from the latent tokens: I2V's condition channels beside each token;
    TI2V's first frame in place of the first latent frame's tokens (an exact select, as diffusers'
    ``(1 - mask) * condition + mask * latents``)."""
    if "condition" in extras:
        return jnp.concatenate([x, extras["condition"]], axis=-1)
    if "first_frame" in extras:
        return jnp.where(extras["in_first_frame"] > 0, extras["first_frame"], x)
    return x


def token_hooks(config: WanConfig) -> TokenHooks:
    """Wan's tokens in the shared loop: I2V reads the condition channels beside each noise token, TI2V's
    first frame replaces the first latent frame, and the head's (patch, channel) features become the
    patch embedding's (channel, patch) order."""
    patch, channels = math.prod(config.patch_size), config.out_channels
    return TokenHooks(
        model_input=_model_input,
        prediction=lambda v: swap_features(v, patch, channels),
        extra_features=config.condition_channels * patch,
    )


def first_frame_tokens(grid: tuple[int, int, int], patch_t: int) -> np.ndarray:
    """[N] bool: the tokens of the first latent frame (patchify order), for a temporal patch of 1."""
    if patch_t != 1:
        raise ValueError(f"first-frame conditioning needs a temporal patch of 1, got {patch_t}")
    return token_positions(grid)[:, 0] == 0


def with_first_frame(latents: np.ndarray, first: np.ndarray) -> np.ndarray:
    """TI2V's result: the given first frame in place of the first latent frame (diffusers does the same)."""
    out = np.array(latents)
    out[:, :, :1] = first
    return out
