"""Parallel attention: one file per strategy, one entry point that picks the strategy from the mesh."""

from jaxdit.parallel.attention import attention_in_shard, parallel_attention, sharded_attention
from jaxdit.parallel.context import ShardContext
from jaxdit.parallel.layout import SequenceLayout
from jaxdit.parallel.local_attention import local_attention

__all__ = [
    "SequenceLayout",
    "ShardContext",
    "attention_in_shard",
    "local_attention",
    "parallel_attention",
    "sharded_attention",
]
