"""Matmul FLOPs of the local attention kernel, as it tiles the work (for the cost model)."""

from __future__ import annotations

import math

from jaxdit.parallel.local_attention import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q

__all__ = ["attention_flops", "tiled"]


def tiled(n: int, block: int) -> int:
    """Length the local attention kernel computes for n tokens: ceil(n/block) even blocks, padded."""
    blocks = max(1, math.ceil(n / block))
    return blocks * math.ceil(n / blocks)


def attention_flops(batch: int, heads: int, queries: int, keys: int, head_dim: int) -> int:
    """Matmul FLOPs of one ``local_attention`` call: QK^T and PV on the padded tiles."""
    return 4 * batch * heads * tiled(queries, DEFAULT_BLOCK_Q) * tiled(keys, DEFAULT_BLOCK_K) * head_dim
