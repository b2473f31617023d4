"""How one generation's tokens lie in PipeFusion's patches and pieces (arXiv 2405.14430), for any family.

A family's geometry (``pipefusion/flux.py``, ``pipefusion/wan.py``) says how its tokens split into M
patches: which token groups a patch has (FLUX: a chunk of the text and some image rows; Wan: video rows
or frames) and how many tokens of each group one patch puts on one of the S = ring x ulysses sequence
shards (a *piece*; padded where the shards do not divide the group, padded tokens masked). This module
derives the rest the same way for every family:

- the local token layouts: one patch on one device (``[group0; group1; ...]`` of that patch), and all
  patches on one device in the warm-up (``[group0 of every patch; group1 of every patch; ...]``), as
  :class:`SequenceLayout` s, so that a model's blocks join/split their token groups as they always do;
- the key masks of fresh K/V (per ring position, as ``ring_attention`` gathers them) and of the K/V
  buffer, None where nothing is padded; with per-sample masks of a group's real tokens (a family whose
  prompts keep their own lengths: :attr:`~jaxdit.pipelines.pipefusion.family.PatchPieces.sample_valid`)
  the same masks per batch row, traced (:meth:`PatchGeometry.sample_masks`);
- :meth:`PatchGeometry.to_slots`: the warm-up's gathered K/V in the buffer's per-patch order.

Shape letters: M patches, S sequence shards (R ring x U ulysses), g_i the piece of group i, L = S * sum g_i
the keys one patch contributes to the buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdit.parallel.layout import SequenceLayout

__all__ = ["PatchGeometry", "SampleMasks"]


class PatchGeometry:
    """What every family's geometry derives from its token groups.

    A subclass is a frozen dataclass with the fields ``patches``, ``ring``, ``ulysses``, ``batch`` (the
    model batch: both CFG branches), ``requests`` (the latent batch), and defines :attr:`pieces`,
    :attr:`latent_piece`, :meth:`piece_valid` and the host-side :meth:`to_patches` / :meth:`from_patches` of its latent tokens.
    """

    patches: int
    ring: int
    ulysses: int
    batch: int
    requests: int

    # ------------------------------------------------------------------ what a family defines
    @property
    def pieces(self) -> tuple[int, ...]:
        """Tokens of each token group in one (patch, sequence shard) piece, in the order a patch holds them."""
        raise NotImplementedError

    @property
    def latent_piece(self) -> int:
        """Tokens of the latent's group in one piece (the tokens the model predicts and the sampler steps)."""
        raise NotImplementedError

    def piece_valid(self) -> tuple[np.ndarray | None, ...]:
        """Per group, [M, S, g] bool: which of a piece's tokens are real (None: all of them)."""
        raise NotImplementedError

    def to_patches(self, x: np.ndarray, axis: int) -> np.ndarray:
        """[..., N, ...] latent tokens (or their positions) -> [..., M, N/M, ...] along ``axis``."""
        raise NotImplementedError

    def from_patches(self, x: np.ndarray, axis: int) -> np.ndarray:
        """Inverse of :meth:`to_patches`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ derived
    @property
    def seq(self) -> int:
        return self.ring * self.ulysses

    @property
    def piece(self) -> int:
        """Tokens of one patch on one sequence shard, every group together."""
        return sum(self.pieces)

    # A context group (a prompt, a reference image, a glyph text) is cut into M chunks of ceil(T / M)
    # tokens whatever the sequence degree, so that every mesh sees the same patches and stale K/V; each
    # chunk is then padded for the S shards. A family's groups other than its latent use these.
    def chunk(self, length: int) -> int:
        """A context group's tokens per patch (the last chunk padded)."""
        return -(-length // self.patches)

    def context_piece(self, length: int) -> int:
        """A context group's tokens per (patch, sequence shard) piece."""
        return -(-self.chunk(length) // self.seq)

    def context_valid(self, length: int) -> np.ndarray:
        """[M, S, t] bool: which padded tokens of a context group of ``length`` are real (patch m, shard
        s, token i holds token m * chunk + s * t + i)."""
        m, s, tp = self.patches, self.seq, self.chunk(length)
        t = -(-tp // s)
        j = np.arange(s * t).reshape(s, t)
        return (j < tp)[None] & (np.arange(m)[:, None, None] * tp + j[None] < length)

    def pad_context(self, x: np.ndarray, axis: int, length: int) -> np.ndarray:
        """[..., T, ...] -> [..., M, S*t, ...] along ``axis``: per-patch chunks of a context group, each
        padded for S shards (zeros; False for a mask)."""
        m, tp = self.patches, self.chunk(length)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, m * tp - length)
        x = np.pad(x, widths).reshape(*x.shape[:axis], m, tp, *x.shape[axis + 1 :])
        widths = [(0, 0)] * x.ndim
        widths[axis + 1] = (0, self.seq * -(-tp // self.seq) - tp)
        return np.pad(x, widths)

    def patch_layout(self) -> SequenceLayout:
        """Local [group0; group1; ...] of one patch on one device (join/split for the blocks)."""
        return SequenceLayout(tuple(self.seq * g for g in self.pieces), self.seq)

    def full_layout(self) -> SequenceLayout:
        """Local [group0 of every patch; group1 of every patch; ...] on one device (warm-up)."""
        return SequenceLayout(tuple(self.seq * self.patches * g for g in self.pieces), self.seq)

    def _valid(self) -> list[np.ndarray] | None:
        groups = self.piece_valid()
        if all(v is None for v in groups):
            return None
        shape = lambda g: (self.patches, self.seq, g)
        return [np.ones(shape(g), bool) if v is None else v for v, g in zip(groups, self.pieces, strict=True)]

    def patch_valid(self) -> np.ndarray | None:
        """[M, R, U*piece]: per patch, the real keys of each ring position's gathered block (None: all)."""
        valid = self._valid()
        return None if valid is None else np.concatenate(valid, -1).reshape(self.patches, self.ring, -1)

    def buffer_valid(self) -> np.ndarray | None:
        """[M, L]: real keys of the buffer's patch slots (slot order: patch, shard, groups); None: all."""
        valid = self.patch_valid()
        return None if valid is None else valid.reshape(self.patches, -1)

    def full_valid(self) -> np.ndarray | None:
        """[R, U*M*piece]: real keys of the gathered full sequence in warm-up order (shard, groups of
        every patch); None: all."""
        valid = self._valid()
        if valid is None:
            return None
        by_shard = [v.transpose(1, 0, 2).reshape(self.seq, -1) for v in valid]  # [S, M*g] each
        return np.concatenate(by_shard, -1).reshape(self.ring, -1)

    def stale_valid(self, patch: jax.Array) -> jax.Array:
        """[M*L]: the buffer's keys ``patch``'s attention reads as stale: real keys of the other patches
        (its own slot is replaced by its fresh K/V)."""
        others = (jnp.arange(self.patches) != patch)[:, None]
        buffer = self.buffer_valid()
        length = self.seq * self.piece
        if buffer is None:
            return jnp.repeat(others[:, 0], length)
        return (jnp.asarray(buffer) & others).reshape(-1)

    def sample_masks(self, samples) -> SampleMasks:
        """The key masks above per batch row, inside the program: ``samples`` holds per group a
        [b, M, S, g] bool array (this device's model batch rows; real tokens of each piece) or None."""
        return SampleMasks(self, samples)

    def to_slots(self, x: jax.Array) -> jax.Array:
        """Warm-up K/V in gathered order [B, S*(M*g_0 + M*g_1 + ...), h, D] -> the buffer's order
        [B, M, S*(g_0 + g_1 + ...), h, D]."""
        b, _, h, d = x.shape
        m, s = self.patches, self.seq
        x = x.reshape(b, s, m * self.piece, h, d)
        bounds = np.cumsum([m * g for g in self.pieces])[:-1].tolist()
        groups = [part.reshape(b, s, m, -1, h, d) for part in jnp.split(x, bounds, axis=2)]
        x = groups[0] if len(groups) == 1 else jnp.concatenate(groups, axis=3)  # [B, S, M, piece, h, D]
        return jnp.swapaxes(x, 1, 2).reshape(b, m, s * self.piece, h, d)


class SampleMasks:
    """:class:`PatchGeometry`'s key masks with a leading batch row axis (b, this device's model batch), for
    groups whose real tokens differ per sample; each is the geometry's static mask AND the samples' (traced
    arrays, inside the program). Shapes as ``patch_attention`` takes them: fresh keys per ring position
    first, then the row."""

    def __init__(self, g: PatchGeometry, samples) -> None:
        self.g = g
        batch = next(s.shape[0] for s in samples if s is not None)
        static = g._valid()
        groups = []
        for i, piece in enumerate(g.pieces):
            shape = (batch, g.patches, g.seq, piece)
            fixed = jnp.ones(shape, bool) if static is None else jnp.broadcast_to(static[i][None], shape)
            groups.append(fixed if samples[i] is None else fixed & samples[i].astype(bool).reshape(shape))
        self.groups = groups  # per group [b, M, S, g]
        self.batch = batch

    def patch_valid(self) -> jax.Array:
        """[M, R, b, U*piece]: per patch and ring position, each row's real keys of the gathered block."""
        g = self.g
        valid = jnp.concatenate(self.groups, -1).reshape(self.batch, g.patches, g.ring, -1)
        return valid.transpose(1, 2, 0, 3)

    def stale_valid(self, patch: jax.Array) -> jax.Array:
        """[b, M*L]: the buffer keys each row of ``patch`` reads as stale (the other patches' real keys)."""
        g = self.g
        buffer = jnp.concatenate(self.groups, -1).reshape(self.batch, g.patches, -1)
        others = (jnp.arange(g.patches) != patch)[None, :, None]
        return (buffer & others).reshape(self.batch, -1)

    def full_valid(self) -> jax.Array:
        """[R, b, U*M*piece]: each row's real keys of the gathered full sequence in warm-up order."""
        g = self.g
        by_shard = [v.transpose(0, 2, 1, 3).reshape(self.batch, g.seq, -1) for v in self.groups]
        valid = jnp.concatenate(by_shard, -1).reshape(self.batch, g.ring, -1)
        return valid.transpose(1, 0, 2)
