"""The Qwen2.5-VL vision tower in JAX: processor patches -> the image tokens the decoder LM reads.

Follows transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` (Bai et al., Qwen2.5-VL technical
report, arXiv 2502.13923): a patch embedding (a Conv3d whose stride equals its kernel, so a linear map of
each flattened ``C x T x P x P`` patch), ``depth`` pre-norm blocks (RMSNorm, multi-head attention with a
2-D rotary embedding, a biased SwiGLU MLP), and a patch merger (RMSNorm, then each 2x2 group of patches
concatenated and sent through a GELU MLP to the LM's width).

Most blocks attend only inside windows of ``window_size`` pixels; the blocks listed in
``fullatt_block_indexes`` attend over each whole image (each frame, for a clip). The tokens are reordered
so every window is contiguous (``window_order``) and attention is restricted by segment ids, which is what
the variable-length ("cu_seqlens") kernels of the reference compute; the merger's output is put back in
raster order at the end.

All index bookkeeping (positions, windows, segments) is numpy on the host from ``grid_thw``; the network
is a jitted function of a parameter dict whose keys are transformers' names (``blocks.0.attn.qkv.weight``).
Precision: fp32 throughout here (the encoder's parity target).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "QwenVisionConfig",
    "full_segments",
    "patch_positions",
    "run_vision",
    "vision_params",
    "window_order",
]

Grid = Sequence[tuple[int, int, int]]


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    """transformers' ``Qwen2_5_VLVisionConfig`` fields the tower needs (defaults: the 7B model)."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 1e4
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} must split into {self.num_heads} heads whose width "
                "is a multiple of 4 (the 2-D rotary embedding gives each axis a quarter of the head)"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"vision hidden_act {self.hidden_act!r}: only silu (Qwen2.5-VL) is supported")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_width(self) -> int:
        """Numbers in one processor patch: C x T x P x P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> QwenVisionConfig:
        """From a ``Qwen2_5_VLConfig`` dict (its ``vision_config``) or the vision config itself."""
        c = dict(config.get("vision_config", config))
        rope = c.get("rope_parameters") or {}
        return cls(
            depth=int(c.get("depth", 32)),
            hidden_size=int(c.get("hidden_size", 1280)),
            intermediate_size=int(c.get("intermediate_size", 3420)),
            num_heads=int(c.get("num_heads", 16)),
            in_channels=int(c.get("in_channels", c.get("in_chans", 3))),
            patch_size=int(c.get("patch_size", 14)),
            temporal_patch_size=int(c.get("temporal_patch_size", 2)),
            spatial_merge_size=int(c.get("spatial_merge_size", 2)),
            window_size=int(c.get("window_size", 112)),
            out_hidden_size=int(c.get("out_hidden_size", 3584)),
            fullatt_block_indexes=tuple(int(i) for i in c.get("fullatt_block_indexes", (7, 15, 23, 31))),
            rope_theta=float(rope.get("rope_theta", 1e4)),
            hidden_act=str(c.get("hidden_act", "silu")),
        )


def _check_grid(cfg: QwenVisionConfig, grid_thw: Grid) -> list[tuple[int, int, int]]:
    grid = [tuple(int(v) for v in g) for g in grid_thw]
    m = cfg.spatial_merge_size
    for t, h, w in grid:
        if t < 1 or h < m or w < m or h % m or w % m:
            raise ValueError(
                f"image grid (t={t}, h={h}, w={w}) patches: h and w must be positive multiples of the "
                f"spatial merge size {m}"
            )
    return grid  # type: ignore[return-value]


def patch_positions(cfg: QwenVisionConfig, grid_thw: Grid) -> np.ndarray:
    """[N, 2] (row, column) of every patch in the processor's order: merge blocks of m x m patches in
    raster order, raster order inside each block, repeated per frame."""
    m = cfg.spatial_merge_size
    out = []
    for t, h, w in _check_grid(cfg, grid_thw):
        grids = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        rows, cols = (a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1) for a in grids)
        out.append(np.tile(np.stack([rows, cols], -1), (t, 1)))
    return np.concatenate(out).astype(np.int64)


def window_order(cfg: QwenVisionConfig, grid_thw: Grid) -> tuple[np.ndarray, np.ndarray]:
    """(order, segments): ``order`` [N / m^2] lists merged tokens window by window (windows of
    window_size / m / patch_size merged tokens a side, the last ones cut at the image edge);
    ``segments`` [N] the window id of every patch after that reordering."""
    m = cfg.spatial_merge_size
    side = cfg.window_size // m // cfg.patch_size
    if side < 1:
        raise ValueError(f"window_size {cfg.window_size} is smaller than one merged patch")
    order, segments, start, window = [], [], 0, 0
    for t, h, w in _check_grid(cfg, grid_thw):
        gh, gw = h // m, w // m
        index = np.arange(t * gh * gw).reshape(t, gh, gw)
        for f in range(t):
            for r0 in range(0, gh, side):
                for c0 in range(0, gw, side):
                    cell = index[f, r0 : r0 + side, c0 : c0 + side].reshape(-1)
                    order.append(cell + start)
                    segments.append(np.full(cell.size * m * m, window))
                    window += 1
        start += t * gh * gw
    return np.concatenate(order), np.concatenate(segments)


def full_segments(cfg: QwenVisionConfig, grid_thw: Grid) -> np.ndarray:
    """[N] the frame id of every patch (full-attention blocks see one whole frame of one image); window
    reordering keeps every patch inside its frame, so this holds before and after it."""
    ids = [np.full(h * w, k) for k, (h, w) in enumerate((h, w) for t, h, w in grid_thw for _ in range(t))]
    return np.concatenate(ids)


def vision_params(tensors: Mapping[str, Any], cfg: QwenVisionConfig) -> dict[str, jax.Array]:
    """The tower's parameters from a state dict (``visual.`` / ``model.visual.`` prefixes dropped), as fp32
    arrays; the Conv3d kernel becomes a [patch_width, E] matrix. Missing or mis-shaped tensors raise."""
    own: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        for prefix in ("model.visual.", "visual."):
            if key.startswith(prefix):
                own[key[len(prefix) :]] = np.asarray(value, np.float32)
    e, f, o = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size
    merged = e * cfg.spatial_merge_size**2
    want = {
        "patch_embed.proj.weight": (
            e,
            cfg.in_channels,
            cfg.temporal_patch_size,
            cfg.patch_size,
            cfg.patch_size,
        ),
        "merger.ln_q.weight": (e,),
        "merger.mlp.0.weight": (merged, merged),
        "merger.mlp.0.bias": (merged,),
        "merger.mlp.2.weight": (o, merged),
        "merger.mlp.2.bias": (o,),
    }
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        want.update(
            {
                b + "norm1.weight": (e,),
                b + "norm2.weight": (e,),
                b + "attn.qkv.weight": (3 * e, e),
                b + "attn.qkv.bias": (3 * e,),
                b + "attn.proj.weight": (e, e),
                b + "attn.proj.bias": (e,),
                b + "mlp.gate_proj.weight": (f, e),
                b + "mlp.gate_proj.bias": (f,),
                b + "mlp.up_proj.weight": (f, e),
                b + "mlp.up_proj.bias": (f,),
                b + "mlp.down_proj.weight": (e, f),
                b + "mlp.down_proj.bias": (e,),
            }
        )
    missing = sorted(set(want) - set(own))
    if missing:
        raise ValueError(f"vision tower tensors missing: {', '.join(missing[:5])} ({len(missing)} in all)")
    bad = [f"{k} {own[k].shape} (want {s})" for k, s in want.items() if own[k].shape != s]
    if bad:
        raise ValueError(f"vision tower tensors of the wrong shape: {'; '.join(bad[:5])}")
    out = {k: jnp.asarray(own[k]) for k in want}
    out["patch_embed.proj.weight"] = out["patch_embed.proj.weight"].reshape(e, -1).T
    return out


def _rms(x: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _linear(p: Mapping[str, jax.Array], name: str, x: jax.Array) -> jax.Array:
    return x @ p[name + ".weight"].T + p[name + ".bias"]


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rotated * sin[:, None]


def _block(p, i, x, cos, sin, same, cfg: QwenVisionConfig):
    b = f"blocks.{i}."
    n, e, heads = x.shape[0], cfg.hidden_size, cfg.num_heads
    h = _rms(x, p[b + "norm1.weight"])
    q, k, v = _linear(p, b + "attn.qkv", h).reshape(n, 3, heads, -1).transpose(1, 0, 2, 3)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    s = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim)
    attn = jax.nn.softmax(jnp.where(same[None], s, -jnp.inf), -1)
    x = x + _linear(p, b + "attn.proj", jnp.einsum("hqk,khd->qhd", attn, v).reshape(n, e))
    h = _rms(x, p[b + "norm2.weight"])
    gate = jax.nn.silu(_linear(p, b + "mlp.gate_proj", h))
    return x + _linear(p, b + "mlp.down_proj", gate * _linear(p, b + "mlp.up_proj", h))


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(cfg, p, patches, cos, sin, window_same, full_same, order, inverse):
    unit = cfg.spatial_merge_size**2
    x = patches @ p["patch_embed.proj.weight"]
    n = x.shape[0]
    regroup = lambda a: a.reshape(n // unit, unit, -1)[order].reshape(n, -1)  # noqa: E731
    x, cos, sin = regroup(x), regroup(cos), regroup(sin)
    for i in range(cfg.depth):
        same = full_same if i in cfg.fullatt_block_indexes else window_same
        x = _block(p, i, x, cos, sin, same, cfg)
    merged = _rms(x, p["merger.ln_q.weight"]).reshape(n // unit, -1)
    merged = _linear(p, "merger.mlp.2", jax.nn.gelu(_linear(p, "merger.mlp.0", merged), approximate=False))
    return merged[inverse]


def run_vision(
    cfg: QwenVisionConfig, params: Mapping[str, jax.Array], pixel_values: Any, grid_thw: Grid
) -> jax.Array:
    """pixel_values [N, patch_width] as the image processor gives them, grid_thw [(t, h, w)] per image ->
    [N / m^2, out_hidden_size] fp32 image tokens, in the order the prompt's image pads take them."""
    grid = _check_grid(cfg, grid_thw)
    patches = np.asarray(pixel_values, np.float32)
    n = sum(t * h * w for t, h, w in grid)
    if patches.shape != (n, cfg.patch_width):
        raise ValueError(
            f"pixel_values {patches.shape} do not match grid_thw {grid}: want ({n}, {cfg.patch_width})"
        )
    d = cfg.head_dim // 2
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    angles = (patch_positions(cfg, grid)[..., None].astype(np.float32) * inv).reshape(n, -1)
    angles = np.concatenate([angles, angles], -1)  # [N, head_dim]: (h, w) frequencies, twice
    order, window_ids = window_order(cfg, grid)
    unit = cfg.spatial_merge_size**2
    frames = full_segments(cfg, grid).reshape(-1, unit)[order].reshape(-1)
    return _forward(
        cfg,
        dict(params),
        jnp.asarray(patches),
        jnp.asarray(np.cos(angles)),
        jnp.asarray(np.sin(angles)),
        jnp.asarray(window_ids[:, None] == window_ids[None, :]),
        jnp.asarray(frames[:, None] == frames[None, :]),
        jnp.asarray(order),
        jnp.asarray(np.argsort(order)),
    )
