"""Qwen2.5-VL as an encoder of instructions with pictures: prompt tokens and processor patches -> hidden
states (what Qwen-Image-Edit conditions on).

The vision tower (:mod:`jaxdit.text_encoders.qwen_vl_vision`) turns each image's patches into tokens;
they replace the prompt's image-pad tokens in order (row-major over the batch, as transformers'
``masked_scatter`` does), and the decoder LM runs on the result with 3-axis positions
(:func:`mrope_positions`): text tokens count up on all three axes, an image's tokens take
(start, start + row, start + column) for its merged grid, and the text after it resumes at
start + max(rows, columns). Padding tokens get position 0 and are masked as keys.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdit.text_encoders.decoder_lm import DecoderLM, Layers
from jaxdit.text_encoders.qwen_vl_vision import Grid, QwenVisionConfig, run_vision

__all__ = ["IMAGE_TOKEN_ID", "QwenVLEncoder", "mrope_positions"]

#: Qwen2.5-VL's ``image_token_id`` when a config names none.
IMAGE_TOKEN_ID = 151655


def mrope_positions(
    input_ids: Any, attention_mask: Any, grid_thw: Grid, image_token_id: int, spatial_merge_size: int
) -> np.ndarray:
    """[3, B, L] int positions as transformers' ``Qwen2_5_VLModel.get_rope_index`` computes them for
    still images (images taken in order across the batch's rows; padding at 0)."""
    ids = np.asarray(input_ids)
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask)
    out = np.zeros((3, *ids.shape), np.int64)
    grids = iter([tuple(int(v) for v in g) for g in grid_thw])
    m = spatial_merge_size
    for row in range(ids.shape[0]):
        real = np.flatnonzero(mask[row] > 0)
        is_image = ids[row, real] == image_token_id
        pieces, pos, i = [], 0, 0
        while i < len(real):
            j = i
            while j < len(real) and is_image[j] == is_image[i]:
                j += 1
            if not is_image[i]:
                pieces.append(np.broadcast_to(np.arange(j - i) + pos, (3, j - i)))
                pos += j - i
            else:
                try:
                    t, h, w = next(grids)
                except StopIteration:
                    raise ValueError("the prompts hold more image-pad runs than images were given") from None
                gt, gh, gw = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij")
                if gt.size != j - i:
                    raise ValueError(
                        f"an image of grid ({t}, {h}, {w}) needs {gt.size} image-pad tokens, the prompt has "
                        f"{j - i}"
                    )
                pieces.append(np.stack([gt, gh, gw]).reshape(3, -1) + pos)
                pos += max(h, w) // m
            i = j
        if pieces:
            out[:, row, real] = np.concatenate(pieces, axis=1)
    if next(grids, None) is not None:
        raise ValueError("more images were given than the prompts have image-pad runs")
    return out


class QwenVLEncoder:
    """The decoder LM and the vision tower, jitted on one device (fp32 reference path)."""

    def __init__(
        self,
        model: DecoderLM,
        vision: QwenVisionConfig,
        params: dict[str, jax.Array],
        image_token_id: int = IMAGE_TOKEN_ID,
    ):
        self.model, self.vision, self.params, self.image_token_id = model, vision, params, image_token_id
        graphdef, self._state = nnx.split(model)

        def run(state, ids, mask, embeds, positions, layers):
            return nnx.merge(graphdef, state)(
                ids, mask, layers=layers, inputs_embeds=embeds, position_ids=positions
            )

        self._jitted = jax.jit(run, static_argnums=(5,))

    def __call__(
        self,
        input_ids: Any,
        attention_mask: Any = None,
        pixel_values: Any = None,
        grid_thw: Grid | None = None,
        *,
        layers: Layers = None,
    ) -> jax.Array:
        """Hidden states [B, L, E] (or [B, n, L, E] for a tuple of ``layers``), fp32."""
        ids = np.asarray(input_ids, np.int32)
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, np.int32)
        if ids.ndim != 2 or mask.shape != ids.shape:
            raise ValueError(
                f"input_ids {ids.shape} and attention_mask {mask.shape} must be one [B, L] shape"
            )
        self.model.layer_indices(layers)
        grid = [] if grid_thw is None else [tuple(int(v) for v in g) for g in np.asarray(grid_thw)]
        slots = (ids == self.image_token_id) & (mask > 0)
        embeds = self.model.embed_tokens[...][jnp.asarray(ids)].astype(jnp.float32)
        if grid:
            tokens = run_vision(self.vision, self.params, pixel_values, grid)
            if tokens.shape[0] != int(slots.sum()):
                raise ValueError(
                    f"{tokens.shape[0]} image tokens from the pictures, {int(slots.sum())} image-pad tokens "
                    "in the prompts"
                )
            rows, cols = np.nonzero(slots)
            embeds = embeds.at[rows, cols].set(tokens)
        elif slots.any():
            raise ValueError("the prompts hold image-pad tokens but no pictures were given")
        positions = mrope_positions(ids, mask, grid, self.image_token_id, self.vision.spatial_merge_size)
        key = layers if layers is None or isinstance(layers, int) else tuple(int(i) for i in layers)
        return self._jitted(self._state, ids, mask, embeds, jnp.asarray(positions, jnp.int32), key)
