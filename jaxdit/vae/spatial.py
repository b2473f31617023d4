"""Spatial (patch) parallelism for convolutional VAEs: image rows split over a 1-D ``tiles`` mesh axis.

The idea is DistVAE's (xDiT's parallel VAE, ``docs/methods/parallel_vae.md``): every device decodes one
horizontal band of the image, and the only places a band needs its neighbours are (1) the rows a
convolution window reaches across the band's edge (the *halo*), (2) GroupNorm's statistics, which are
taken over the whole image, and (3) the mid-block self-attention, whose keys are every pixel. Everything
else (1x1 convs, SiLU, nearest upsampling, residual adds) is local. The result is exact: the sharded
decode equals the unsharded one to fp32 rounding.

Layout
------
Activations are channels-last, ``[B, (T,) H, W, C]``: any leading dims, then rows H, columns W, channels
C (the row axis is always ``-3``). A :class:`Rows` describes how the ``rows`` real rows of one resolution
live on ``tiles`` devices: each tile holds ``local`` consecutive rows (tile t owns global rows
``[t*local, (t+1)*local)``), and rows at or past ``rows`` are padding. Heights the device count does not
divide are padded at the end, so some tiles may hold only padding (5 latent rows on 4 tiles: 2, 2, 1+1
pad, 2 pad) -- this is allowed: those tiles compute garbage that is never used, and the decode is still
exact. Which rows are real is a static function of the tile index, so each device computes its own
valid-row mask locally (like ``jaxdit.parallel.layout`` does for tokens) and no mask is communicated.

The rules that make padding exact:

- Every convolution first zeroes the padded rows (:func:`mask_rows`); a padded row is then the same zero
  row that 'same' padding puts below the image, and a halo that comes from beyond the global edge is
  zero too (non-cyclic ``ppermute``: the first tile receives nothing from above, the last nothing from
  below, and a ``ppermute`` target that no pair feeds receives zeros).
- A convolution that pads with the edge values instead of zeros (replicate) takes its halo with
  ``halo(..., mode="edge")``: the rows beyond the image are then copies of its first and last real rows,
  wherever the last real row falls in its band (:func:`edge_rows`), and the padding rows need no mask.
- GroupNorm sums only real rows, and divides by the real count.
- Attention masks padded keys (and zeroes their values; a masked key's probability is 0, but 0 * NaN of
  garbage would not be).

Communication per op (P tiles; all of it shrinks with the band, none of it is a full activation):

- 'same' k x k conv: :func:`halo` sends ``k//2`` rows to each neighbour: two collective-permutes (the
  edge mode adds none).
- FLUX's down-sampling conv (pad right/bottom by 1, 3x3 stride 2, no other padding): output row i
  reads input rows 2i..2i+2, so a tile with an even number of local rows needs exactly ONE extra row,
  the first row of the tile below (zero at the bottom edge: that is the pad row). No row goes upwards.
- Nearest 2x upsampling: none (each tile repeats its own rows; ``local`` and ``rows`` double).
- GroupNorm: two all-reduces of [B, G] fp32 values: the per-tile sums, then (after every tile knows the
  global mean) the per-tile sums of squared deviations from that mean. Two passes cost one more tiny
  all-reduce than sum/sum-of-squares, but avoid the cancellation of E[x^2] - E[x]^2, so the sharded
  variance equals the unsharded two-pass variance to rounding.
- Attention: Ring attention (``jaxdit.parallel.ring``) over the tiles: each tile keeps its queries and
  passes its K/V band around the ring (P-1 hops of collective-permutes), merging partial results by
  log-sum-exp in fp32; the local kernel is blockwise (online softmax). Chosen over an all-gather of K/V
  because per-device memory then stays 1/P of the K/V (FLUX at 1024px: 16384 tokens x 512 channels; an
  all-gather would hold all of it, plus a [tokens/P, 16384] score matrix, on every device) and because
  the compiled program then contains only permutes and the norm all-reduces.

Everything here runs inside ``jax.shard_map`` over a mesh that has the axis ``rows.axis_name``
(:func:`tile_mesh` builds the 1-D one from any mesh), and works unchanged with one tile (no collective
is emitted then), so the unsharded model is the same code.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, PartitionSpec

from jaxdit.parallel.local_attention import local_attention, merge_partials
from jaxdit.parallel.ring import ring_attention

__all__ = [
    "TILE_AXIS",
    "Rows",
    "attention",
    "conv2d",
    "downsample_conv",
    "edge_rows",
    "frame_causal_attention",
    "group_norm",
    "halo",
    "mask_rows",
    "pad_rows",
    "row_spec",
    "tile_index",
    "tile_mesh",
    "unpad_rows",
    "upsample_nearest",
]

#: The mesh axis the rows are split over.
TILE_AXIS = "tiles"
#: Rows are always axis -3 of a channels-last activation [..., H, W, C].
ROW_AXIS = -3


@dataclasses.dataclass(frozen=True)
class Rows:
    """``rows`` real rows on ``tiles`` tiles of ``local`` rows each (padding at the global end).

    Static (hashable); the same object describes the global array (``padded`` rows) and every tile's
    local view (``local`` rows). Build it with :meth:`split`; :meth:`upsampled` and
    :meth:`downsampled` follow the resolution changes of a decoder/encoder.
    """

    rows: int
    local: int
    tiles: int
    axis_name: str = TILE_AXIS

    def __post_init__(self) -> None:
        if self.rows < 1 or self.tiles < 1 or self.local < 1:
            raise ValueError(f"bad row layout: rows={self.rows}, local={self.local}, tiles={self.tiles}")
        if self.local * self.tiles < self.rows:
            raise ValueError(
                f"{self.tiles} tiles of {self.local} rows cannot hold {self.rows} rows "
                f"(need local >= {math.ceil(self.rows / self.tiles)})"
            )

    @classmethod
    def split(cls, rows: int, tiles: int, multiple: int = 1, axis_name: str = TILE_AXIS) -> Rows:
        """``rows`` over ``tiles``: ceil(rows / tiles) local rows, rounded up to ``multiple`` (an encoder
        with n stride-2 downsamplings needs a multiple of 2**n so every tile's band halves evenly)."""
        local = math.ceil(rows / tiles)
        local = math.ceil(local / multiple) * multiple
        return cls(rows, local, tiles, axis_name)

    @property
    def padded(self) -> int:
        """Global rows including padding: ``local * tiles``."""
        return self.local * self.tiles

    @property
    def padding(self) -> int:
        return self.padded - self.rows

    def valid_for(self, tile: jax.Array | int) -> jax.Array:
        """[local] bool: which of ``tile``'s rows are real (``tile`` may be traced)."""
        return tile * self.local + jnp.arange(self.local) < self.rows

    def valid(self) -> jax.Array:
        """[local] bool for this device's tile (inside ``shard_map``)."""
        return self.valid_for(tile_index(self))

    def valid_rows_of(self, tile: int) -> int:
        """Number of real rows on ``tile`` (static)."""
        return int(np.clip(self.rows - tile * self.local, 0, self.local))

    def upsampled(self, factor: int = 2) -> Rows:
        """The layout after nearest upsampling by ``factor``: every tile's band grows in place."""
        return Rows(self.rows * factor, self.local * factor, self.tiles, self.axis_name)

    def downsampled(self) -> Rows:
        """The layout after FLUX's down-sampling conv: floor(rows / 2) real rows, half the band."""
        if self.local % 2:
            raise ValueError(
                f"a stride-2 downsampling needs an even number of rows per tile, got {self.local}; "
                "build the layout with Rows.split(..., multiple=2**levels)"
            )
        if self.rows < 2:
            raise ValueError(f"cannot downsample {self.rows} row(s) with a 3x3 stride-2 conv")
        return Rows(self.rows // 2, self.local // 2, self.tiles, self.axis_name)


# --------------------------------------------------------------------------------------------------------
# Mesh and global view
# --------------------------------------------------------------------------------------------------------


def tile_mesh(mesh_or_devices: Mesh | Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over ALL devices of ``mesh_or_devices`` (a mesh's ``devices.flat`` order), axis
    :data:`TILE_AXIS`. ``None``: every device."""
    if mesh_or_devices is None:
        devices = list(jax.devices())
    elif isinstance(mesh_or_devices, Mesh):
        devices = list(mesh_or_devices.devices.flat)
    else:
        devices = list(mesh_or_devices)
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(grid, (TILE_AXIS,), axis_types=(AxisType.Auto,))


def row_spec(ndim: int, axis_name: str = TILE_AXIS) -> PartitionSpec:
    """PartitionSpec of a channels-last activation of rank ``ndim`` with rows (axis -3) on the tiles."""
    return PartitionSpec(*([None] * (ndim - 3)), axis_name, None, None)


def pad_rows(x: jax.Array, rows: Rows) -> jax.Array:
    """Global view: pad the real rows (axis -3) with zeros to ``rows.padded``."""
    if x.shape[ROW_AXIS] != rows.rows:
        raise ValueError(f"array has {x.shape[ROW_AXIS]} rows, layout says {rows.rows}")
    widths = [(0, 0)] * x.ndim
    widths[x.ndim + ROW_AXIS] = (0, rows.padding)
    return jnp.pad(x, widths) if rows.padding else x


def unpad_rows(x: jax.Array, rows: Rows) -> jax.Array:
    """Global view: drop the padding rows."""
    return lax.slice_in_dim(x, 0, rows.rows, axis=x.ndim + ROW_AXIS)


# --------------------------------------------------------------------------------------------------------
# Local view (inside shard_map)
# --------------------------------------------------------------------------------------------------------


def tile_index(rows: Rows) -> jax.Array:
    """This device's tile (traced); 0 without a collective when there is one tile."""
    return lax.axis_index(rows.axis_name) if rows.tiles > 1 else jnp.int32(0)


def _row_mask(valid: jax.Array, ndim: int) -> jax.Array:
    """[local] -> broadcastable against [..., local, W, C]."""
    return valid.reshape((1,) * (ndim - 3) + (-1, 1, 1))


def mask_rows(x: jax.Array, rows: Rows) -> jax.Array:
    """Zero the padded rows of a local band (``where``, so garbage NaNs do not leak)."""
    if rows.padding == 0:
        return x
    return jnp.where(_row_mask(rows.valid(), x.ndim), x, jnp.zeros((), x.dtype))


def _shift(x: jax.Array, rows: Rows, step: int) -> jax.Array:
    """Tile t receives tile (t - step)'s ``x``; tiles with no such source receive zeros."""
    if rows.tiles == 1:
        return jnp.zeros_like(x)
    pairs = [(t, t + step) for t in range(rows.tiles) if 0 <= t + step < rows.tiles]
    return lax.ppermute(x, rows.axis_name, pairs)


def halo(x: jax.Array, rows: Rows, before: int, after: int, mode: str = "zero") -> jax.Array:
    """The band with ``before`` rows of the tile above and ``after`` rows of the tile below attached.

    [..., local, W, C] -> [..., before + local + after, W, C]. ``mode`` says what stands beyond the
    image's edges: ``"zero"``, zero rows (mask first, :func:`mask_rows`, so that padding rows a neighbour
    sends are zero as well); ``"edge"``, copies of the nearest real row (the first row above the image,
    the last real row below it and in place of the padding rows), as a replicate-padded convolution
    reads them (:func:`edge_rows`).
    """
    if mode not in ("zero", "edge"):
        raise ValueError(f"halo mode must be 'zero' or 'edge', got {mode!r}")
    if before > rows.local or after > rows.local:
        raise ValueError(
            f"a halo of {before} above / {after} below needs at least that many rows per tile, "
            f"but tiles hold {rows.local}; use fewer tiles"
        )
    axis = x.ndim + ROW_AXIS
    parts = []
    if before:
        parts.append(_shift(lax.slice_in_dim(x, rows.local - before, rows.local, axis=axis), rows, 1))
    parts.append(x)
    if after:
        parts.append(_shift(lax.slice_in_dim(x, 0, after, axis=axis), rows, -1))
    band = jnp.concatenate(parts, axis=axis) if len(parts) > 1 else x
    return edge_rows(band, rows, before) if mode == "edge" else band


def edge_rows(band: jax.Array, rows: Rows, before: int) -> jax.Array:
    """Rows of ``band`` (a tile's rows with ``before`` halo rows above) that lie beyond the image -> the
    nearest real row: row 0 above the image, row ``rows.rows - 1`` below it (padding rows included).

    Local, no communication: the tile that holds the last real row holds every row that must copy it,
    or receives them in its halo. Without padding only the halo rows of the first and last tile change
    (two ``where``s on the halo rows); with padding the band is re-read through a row index (a gather),
    since the last real row may sit anywhere in its tile. Tiles past the last real row keep garbage,
    which no real row reads.
    """
    axis = band.ndim + ROW_AXIS
    n = band.shape[axis]
    after = n - before - rows.local
    tile = tile_index(rows)
    if rows.padding == 0:
        pieces = [lax.slice_in_dim(band, before, before + rows.local, axis=axis)]
        if before:
            top = lax.slice_in_dim(band, before, before + 1, axis=axis)
            received = lax.slice_in_dim(band, 0, before, axis=axis)
            pieces.insert(0, jnp.where(tile == 0, jnp.repeat(top, before, axis=axis), received))
        if after:
            last = lax.slice_in_dim(band, before + rows.local - 1, before + rows.local, axis=axis)
            received = lax.slice_in_dim(band, n - after, n, axis=axis)
            pieces.append(jnp.where(tile == rows.tiles - 1, jnp.repeat(last, after, axis=axis), received))
        return jnp.concatenate(pieces, axis=axis) if len(pieces) > 1 else band
    start = tile * rows.local - before  # the global row of the band's first row
    source = jnp.clip(start + jnp.arange(n), 0, rows.rows - 1) - start
    return jnp.take(band, jnp.clip(source, 0, n - 1), axis=axis)


def _conv_valid(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, stride: int) -> jax.Array:
    """VALID 2-D conv of [..., H, W, Ci] with an HWIO kernel, fp32 accumulation, leading dims folded."""
    lead = x.shape[:-3]
    x4 = x.reshape((-1,) + x.shape[-3:]).astype(kernel.dtype)
    y = lax.conv_general_dilated(
        x4,
        kernel,
        window_strides=(stride, stride),
        padding="VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        preferred_element_type=jnp.float32,
    )
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(kernel.dtype).reshape(lead + y.shape[1:])


def conv2d(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, rows: Rows) -> jax.Array:
    """'same' conv (odd square kernel [k, k, Ci, Co], stride 1, zero padding k//2) of a local band.

    Padded rows are zeroed, ``k//2`` halo rows come from each neighbour, columns are zero padded
    locally. Output: [..., local, W, Co] in the kernel's dtype (fp32 accumulation).
    """
    k = kernel.shape[0]
    if kernel.shape[1] != k or k % 2 == 0:
        raise ValueError(f"conv2d takes an odd square kernel, got {kernel.shape}")
    p = k // 2
    if p == 0:  # 1x1: purely local, padding rows are garbage-in garbage-out
        return _conv_valid(x, kernel, bias, 1)
    h = halo(mask_rows(x, rows), rows, p, p)
    widths = [(0, 0)] * h.ndim
    widths[-2] = (p, p)
    return _conv_valid(jnp.pad(h, widths), kernel, bias, 1)


def downsample_conv(
    x: jax.Array, kernel: jax.Array, bias: jax.Array | None, rows: Rows
) -> tuple[jax.Array, Rows]:
    """FLUX/LDM down-sampling: pad (left 0, right 1, top 0, bottom 1), then 3x3 stride-2 VALID conv.

    Output row i of a tile reads its input rows 2i, 2i+1, 2i+2; with an even band only the last output
    row reaches past it, by ONE row: the first row of the tile below (zero below the last tile, which is
    the bottom pad row; a padding row of the band, zeroed, is the same pad row). Returns the output band
    and its layout (:meth:`Rows.downsampled`).
    """
    if kernel.shape[:2] != (3, 3):
        raise ValueError(f"downsample_conv takes a 3x3 kernel, got {kernel.shape}")
    out_rows = rows.downsampled()
    h = halo(mask_rows(x, rows), rows, 0, 1)
    widths = [(0, 0)] * h.ndim
    widths[-2] = (0, 1)
    return _conv_valid(jnp.pad(h, widths), kernel, bias, 2), out_rows


def upsample_nearest(x: jax.Array, rows: Rows, factor: int = 2) -> tuple[jax.Array, Rows]:
    """Nearest-neighbour upsampling of rows and columns by ``factor``; local (no communication)."""
    x = jnp.repeat(x, factor, axis=x.ndim - 3)
    x = jnp.repeat(x, factor, axis=x.ndim - 2)
    return x, rows.upsampled(factor)


def _psum(x: jax.Array, rows: Rows) -> jax.Array:
    return lax.psum(x, rows.axis_name) if rows.tiles > 1 else x


def group_norm(
    x: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    groups: int,
    rows: Rows,
    eps: float = 1e-6,
) -> jax.Array:
    """GroupNorm over the whole (sharded) image: statistics per (batch, group) over every real row.

    x [B, ..., local, W, C]: axis 0 is the batch, the last is channels; statistics reduce every other
    axis (rows, columns, frames, channels of the group). Computed in fp32, two passes (module docstring):
    the global mean from the all-reduced sums, then the variance from all-reduced squared deviations,
    each divided by the static count of real elements. Returns x's dtype.
    """
    c = x.shape[-1]
    if c % groups:
        raise ValueError(f"{c} channels do not split into {groups} groups")
    xg = x.astype(jnp.float32).reshape(x.shape[:-1] + (groups, c // groups))
    axes = tuple(i for i in range(1, xg.ndim) if i != xg.ndim - 2)
    count = rows.rows * math.prod(xg.shape[1:-4]) * x.shape[-2] * (c // groups)
    valid = rows.valid().reshape((1,) * (xg.ndim - 4) + (-1, 1, 1, 1)) if rows.padding else None

    def masked(v):
        return v if valid is None else jnp.where(valid, v, 0.0)

    mean = _psum(masked(xg).sum(axes), rows) / count  # [B, G]
    mean = mean.reshape(mean.shape[:1] + (1,) * (xg.ndim - 3) + mean.shape[1:] + (1,))
    dev = xg - mean
    var = _psum(jnp.square(masked(dev)).sum(axes), rows) / count
    var = var.reshape(mean.shape)
    y = (dev * lax.rsqrt(var + eps)).reshape(x.shape)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, rows: Rows, **kernel_kwargs) -> jax.Array:
    """Single-head softmax attention of every pixel over every real pixel of the whole image.

    q/k/v [B, ..., local, W, C] (leading dims other than B fold into the batch: Wan attends per frame
    by passing [B, T, ...]); scale 1/sqrt(C). Ring attention over the tiles (module docstring), padded
    keys masked and their values zeroed. ``kernel_kwargs``: ``local_attention``'s (``backend``, tiles).
    Returns [B, ..., local, W, C] in q's dtype.
    """
    shape = q.shape
    lead, w, c = shape[:-3], shape[-2], shape[-1]
    if rows.padding:
        v = mask_rows(v, rows)
        k = mask_rows(k, rows)

    def tokens(t):
        return t.reshape((math.prod(lead), rows.local * w, 1, c))

    def key_valid_for(src):
        if rows.padding == 0:
            return None
        per_row = rows.valid_for(src)
        return jnp.broadcast_to(jnp.repeat(per_row, w)[None], (math.prod(lead), rows.local * w))

    out, _ = ring_attention(
        tokens(q),
        tokens(k),
        tokens(v),
        rows.tiles,
        key_valid_for,
        axis_name=rows.axis_name,
        **kernel_kwargs,
    )
    return out.reshape(shape)


def frame_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, rows: Rows, **kernel_kwargs
) -> jax.Array:
    """Single-head attention over every real pixel of the whole clip, causal over frames: a query of
    frame i sees the keys of frames 0..i on every tile.

    q/k/v [B, T, local, W, C]; scale 1/sqrt(C). The K/V band of all frames goes round the tiles as in
    Ring attention (P-1 hops, the next hop's permute issued before the local work); on each band a scan
    over its key frames j attends every query to frame j's keys with the local kernel (blockwise,
    ``kernel_kwargs`` as for :func:`attention`), drops the partial of the queries of frames before j, and
    merges the rest by log-sum-exp in fp32. The local work is every (query frame, key frame) pair, twice
    the causal half; in exchange no mask depends on the query inside the kernel and memory stays one
    frame's keys against the tile's queries. Returns [B, T, local, W, C] in q's dtype.
    """
    b, t, local, w, c = q.shape
    if rows.padding:
        k = mask_rows(k, rows)
        v = mask_rows(v, rows)
    queries = q.reshape(b, t * local * w, 1, c)
    query_frame = jnp.repeat(jnp.arange(t), local * w)[None, :, None]  # [1, Tq, 1]

    def band(carry, kb, vb, source):
        key_valid = None
        if rows.padding:
            key_valid = jnp.broadcast_to(jnp.repeat(rows.valid_for(source), w)[None], (b, local * w))

        def frame(state, j):
            kj = lax.dynamic_index_in_dim(kb, j, 1, keepdims=False).reshape(b, local * w, 1, c)
            vj = lax.dynamic_index_in_dim(vb, j, 1, keepdims=False).reshape(b, local * w, 1, c)
            o, lse = local_attention(queries, kj, vj, key_valid, out_dtype=jnp.float32, **kernel_kwargs)
            seen = query_frame >= j
            o = jnp.where(seen[..., None], o, 0.0)
            lse = jnp.where(seen, lse, -jnp.inf)
            return merge_partials(*state, o, lse), None

        return lax.scan(frame, carry, jnp.arange(t))[0]

    carry = (jnp.zeros(queries.shape, jnp.float32), jnp.full(queries.shape[:3], -jnp.inf, jnp.float32))
    me = tile_index(rows)
    forward = [(i, (i + 1) % rows.tiles) for i in range(rows.tiles)]
    for hop in range(rows.tiles):  # static; the last hop sends nothing
        if hop < rows.tiles - 1:
            k_next = lax.ppermute(k, rows.axis_name, forward)
            v_next = lax.ppermute(v, rows.axis_name, forward)
        carry = band(carry, k, v, (me - hop) % rows.tiles)
        if hop < rows.tiles - 1:
            k, v = k_next, v_next
    return carry[0].astype(q.dtype).reshape(q.shape)
