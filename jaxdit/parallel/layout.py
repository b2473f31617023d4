"""Shard-major token layout: how token groups of any length live on S = ring x ulysses sequence shards.

Each token group (FLUX's text and image tokens, Kontext's reference-image tokens; Wan's video tokens) is padded to a multiple of S and split
into S equal pieces. Shard s holds ``[group0_s; group1_s; ...]``: the groups are joined per shard and
never concatenated globally (a global concatenation of two sharded arrays makes XLA move data). Every
token carries its own RoPE position, so every op except attention is per-token; attention masks the
padded keys, and the padded queries are dropped at the end. The result is exact.

Which keys are padding is a static function of the group lengths and the shard index, so every device
computes any shard's mask locally: no mask is communicated.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """Token groups of global lengths ``lengths`` on ``shards`` sequence shards."""

    lengths: tuple[int, ...]
    shards: int

    def __post_init__(self) -> None:
        if self.shards < 1 or not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"bad sequence layout: lengths={self.lengths}, shards={self.shards}")

    @property
    def local_lengths(self) -> tuple[int, ...]:
        """Tokens of each group on one shard (padding included)."""
        return tuple(math.ceil(n / self.shards) for n in self.lengths)

    @property
    def local_length(self) -> int:
        return sum(self.local_lengths)

    @property
    def padded_lengths(self) -> tuple[int, ...]:
        return tuple(n * self.shards for n in self.local_lengths)

    @property
    def padding(self) -> int:
        """Total padded tokens, all shards together."""
        return sum(self.padded_lengths) - sum(self.lengths)

    # ------------------------------------------------------------ global view
    def pad(self, x, group: int, axis: int = 1, value=0):
        """Pad a global group array along ``axis`` to its padded length (numpy or jax)."""
        extra = self.padded_lengths[group] - x.shape[axis]
        if x.shape[axis] != self.lengths[group]:
            raise ValueError(f"group {group} has {x.shape[axis]} tokens, layout says {self.lengths[group]}")
        if extra == 0:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        lib = np if isinstance(x, np.ndarray) else jnp
        return lib.pad(x, widths, constant_values=value)

    def unpad(self, x, group: int, axis: int = 1):
        """Drop a group's padding along ``axis`` (numpy stays numpy)."""
        if isinstance(x, np.ndarray):
            index = [slice(None)] * x.ndim
            index[axis] = slice(0, self.lengths[group])
            return x[tuple(index)]
        return jax.lax.slice_in_dim(x, 0, self.lengths[group], axis=axis)

    # ------------------------------------------------------------- local view
    def split_local(self, x: jax.Array, axis: int = 1) -> list[jax.Array]:
        """A shard's joined tokens -> one piece per group."""
        bounds = np.cumsum(self.local_lengths)[:-1].tolist()
        return jnp.split(x, bounds, axis=axis)

    def split_after(self, x: jax.Array, group: int, axis: int = 1) -> list[jax.Array]:
        """A shard's joined tokens -> [groups 0..group joined, the later groups joined]: two streams
        that each carry several groups (FLUX's image stream: the image, then reference images)."""
        return jnp.split(x, [sum(self.local_lengths[: group + 1])], axis=axis)

    def join_local(self, pieces, axis: int = 1) -> jax.Array:
        return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=axis)

    def key_valid(self, shard) -> jax.Array:
        """[local_length] bool: which of shard ``shard``'s tokens are real (shard may be traced)."""
        parts = []
        for n_global, n_local in zip(self.lengths, self.local_lengths, strict=True):
            parts.append(shard * n_local + jnp.arange(n_local) < n_global)
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    def all_keys_valid(self) -> np.ndarray:
        """[shards * local_length] bool (static): :meth:`key_valid` of every shard, in shard order."""
        parts = []
        for shard in range(self.shards):
            for n_global, n_local in zip(self.lengths, self.local_lengths, strict=True):
                parts.append(shard * n_local + np.arange(n_local) < n_global)
        return np.concatenate(parts)

    def local_key_mask(self, masks) -> jax.Array:
        """Per-group masks of this shard's tokens -> the joined [B, local_length] key mask.

        ``masks``: one [B, local_lengths[g]] bool array per group, or None for a group whose real tokens
        are only those the padding leaves (image tokens). At least one must be an array (it gives B).
        """
        if len(masks) != len(self.lengths):
            raise ValueError(f"{len(masks)} key masks for {len(self.lengths)} token groups")
        batch = next((m.shape[0] for m in masks if m is not None), None)
        if batch is None:
            raise ValueError("local_key_mask needs at least one group's mask")
        pieces = []
        for m, n_local in zip(masks, self.local_lengths, strict=True):
            if m is None:
                m = jnp.ones((batch, n_local), bool)
            elif m.shape != (batch, n_local):
                raise ValueError(f"a group's key mask has shape {m.shape}; expected {(batch, n_local)}")
            pieces.append(m.astype(bool))
        return self.join_local(pieces)

    def has_padding(self) -> bool:
        return self.padding > 0
