"""A tiny random diffusers ``Flux2Transformer2DModel`` and inputs for it, with reference images.

Four heads of 16 (so ulysses2 x tensor2 splits them), two double and two single blocks, RoPE axes
(4, 4, 4, 4); every weight perturbed away from its initial value (norm scales not all ones, the
zero-initialised layers non-zero).
"""

from __future__ import annotations

import numpy as np
import torch

from jaxdit.models.flux2_config import image_ids, reference_ids, text_ids

CONFIG = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=24,
    timestep_guidance_channels=32,
    mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=True,
)


def transformer(seed: int = 0, scale: float = 0.1, **overrides) -> torch.nn.Module:
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(**{**CONFIG, **overrides})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


def inputs(batch: int, text: int, grid: tuple[int, int], refs=(), guidance=True, seed: int = 0) -> dict:
    """Packed latents [B, rows*cols, C], text features [B, T, C'], sigmas [B], guidance [B] (or none),
    the ids as the pipelines build them, and, for each (rows, cols) in ``refs``, a reference image's
    packed latents joined along the sequence with its ids (time 10, 20, ...)."""
    rng = np.random.default_rng(seed)
    rows, cols = grid
    x = dict(
        hidden_states=rng.standard_normal((batch, rows * cols, CONFIG["in_channels"])).astype(np.float32),
        encoder_hidden_states=rng.standard_normal((batch, text, CONFIG["joint_attention_dim"])).astype(
            np.float32
        ),
        timestep=rng.uniform(0.05, 1.0, batch).astype(np.float32),
        img_ids=image_ids(rows, cols),
        txt_ids=text_ids(text),
    )
    if guidance:
        x["guidance"] = rng.uniform(1.0, 5.0, batch).astype(np.float32)
    if refs:
        n = sum(r * c for r, c in refs)
        x["reference_hidden_states"] = rng.standard_normal((batch, n, CONFIG["in_channels"])).astype(
            np.float32
        )
        x["reference_ids"] = reference_ids(list(refs))
    return x


def reference(model: torch.nn.Module, x: dict) -> np.ndarray:
    """diffusers' forward as its pipelines call it: reference latents and ids appended to the image's,
    the prediction cut back to the denoised tokens."""
    img, ids = x["hidden_states"], x["img_ids"]
    if "reference_hidden_states" in x:
        img = np.concatenate([img, x["reference_hidden_states"]], axis=1)
        ids = np.concatenate([ids, x["reference_ids"]], axis=0)
    batch = img.shape[0]
    with torch.no_grad():
        out = model(
            hidden_states=torch.from_numpy(img),
            encoder_hidden_states=torch.from_numpy(x["encoder_hidden_states"]),
            timestep=torch.from_numpy(x["timestep"]),
            img_ids=torch.from_numpy(np.broadcast_to(ids, (batch, *ids.shape)).copy()),
            txt_ids=torch.from_numpy(np.broadcast_to(x["txt_ids"], (batch, *x["txt_ids"].shape)).copy()),
            guidance=torch.from_numpy(x["guidance"]) if "guidance" in x else None,
            return_dict=False,
        )[0]
    return out.numpy()[:, : x["hidden_states"].shape[1]]
