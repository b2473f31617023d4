"""What a model sees inside ``shard_map``: its local tokens and the few collectives it may call.

Model code never names a mesh axis. It calls ``ctx.attention`` for self-attention over the whole
(sharded) sequence and ``ctx.sum_tensor_parallel`` after a row-parallel projection; both are no-ops in
communication when the corresponding degrees are 1, so one model file serves every configuration.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax import lax

from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.attention import attention_in_shard, gather_key_mask
from jaxdit.parallel.kernels import check_kernel_options
from jaxdit.parallel.layout import SequenceLayout


@dataclasses.dataclass(frozen=True)
class ShardContext:
    """Static description of one shard: the mesh's degrees and the token layout of self-attention."""

    config: ParallelConfig
    layout: SequenceLayout
    #: Options of the local attention kernel as sorted (name, value) pairs: ``backend`` (auto, xla, cudnn,
    #: triton, splash), the XLA kernel's tiles ``block_q``/``block_k``, ``interpret``, ``platform``
    #: (``jaxdit.parallel.kernels.KERNEL_OPTIONS``); defaults when empty.
    kernel: tuple[tuple[str, Any], ...] = ()
    #: Which keys of every shard are real, per batch element: [B_local, shards * n_local] bool in shard
    #: order (padding False), gathered once per forward by :meth:`with_key_mask`; None: only the layout's
    #: padding is masked (a static function of the shard index, nothing communicated).
    key_mask: jax.Array | None = None
    #: The stacked weights' per-layer all-gathers under fsdp (``jaxdit.parallel.fsdp.Gathers``): what the
    #: scan over each stack gathers before a layer runs; () when the weights are not fsdp-sharded.
    gathers: tuple = ()

    def __post_init__(self) -> None:
        check_kernel_options(dict(self.kernel))

    def backend_options(self) -> dict[str, Any]:
        """The kernel options that choose the backend (not the XLA tiles): for attention a model calls
        on its own, e.g. Wan's cross-attention to the text tokens."""
        return {k: v for k, v in self.kernel if k not in ("block_q", "block_k")}

    def with_key_mask(self, group_masks) -> ShardContext:
        """This context with per-sample key masks: ``group_masks`` holds, per token group, this shard's
        [B, local_lengths[g]] bool mask of real tokens (e.g. each prompt's length), or None for a group
        whose tokens are all real. Inside ``shard_map``: gathers the joined mask over the sequence shards
        once, so every attention call of the forward slices it locally. All None: unchanged."""
        if all(m is None for m in group_masks):
            return self
        mask = gather_key_mask(self.layout.local_key_mask(group_masks), self.layout)
        return dataclasses.replace(self, key_mask=mask)

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """Self-attention over every shard's tokens; q/k/v [B, n_local, H_local, D] in the layout. Keys
        the layout pads and keys :attr:`key_mask` marks False are masked."""
        return attention_in_shard(
            q, k, v, self.layout, self.config, all_keys=self.key_mask, **dict(self.kernel)
        )

    def group_attention(self, group: int):
        """Self-attention over one token group of the layout alone (a refiner's: Z-Image's image or
        caption, HunyuanVideo 1.5's prompt): ``fn(q, k, v)`` on that group's local tokens
        [B, local_lengths[group], H_local, D]. It uses the group's own layout on the same shards (no data
        moved), its slice of :attr:`key_mask` and the same kernel options."""
        layout = self.layout
        sub = SequenceLayout((layout.lengths[group],), layout.shards)
        keys = self.key_mask
        if keys is not None:
            start = sum(layout.local_lengths[:group])
            per_shard = keys.reshape(keys.shape[0], layout.shards, layout.local_length)
            keys = per_shard[:, :, start : start + layout.local_lengths[group]].reshape(keys.shape[0], -1)
        kernel = dict(self.kernel)
        return lambda q, k, v: attention_in_shard(q, k, v, sub, self.config, all_keys=keys, **kernel)

    def sum_tensor_parallel(self, x: jax.Array) -> jax.Array:
        """All-reduce over the tensor axis: completes a row-parallel projection's partial sums."""
        return lax.psum(x, "tensor") if self.config.tensor > 1 else x

    def max_tensor_parallel(self, x: jax.Array) -> jax.Array:
        """Maximum over the tensor axis (an FP8 row-parallel layer's per-token activation scale)."""
        return lax.pmax(x, "tensor") if self.config.tensor > 1 else x

    def sequence_shard(self) -> jax.Array:
        """Index of this device's sequence shard, ring-major (traced)."""
        if self.layout.shards == 1:
            return jax.numpy.int32(0)
        return lax.axis_index("ring") * self.config.ulysses + lax.axis_index("ulysses")

    def token_valid(self) -> jax.Array:
        """[n_local] bool: which local tokens are real, not padding."""
        return self.layout.key_valid(self.sequence_shard())
