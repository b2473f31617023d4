"""Logical axis name -> mesh axes, as data. One preset per strategy; :func:`rules_for` composes them.

Parameters and activations declare logical names; these tables are the only place that says which mesh
axis a logical name lands on. A name absent from the table is replicated.
"""

from __future__ import annotations

from types import MappingProxyType

#: A rule table: logical name -> a mesh axis, a tuple of mesh axes (outer first), or None.
Rules = MappingProxyType

#: Activations inside a denoising step (every preset includes these).
#: batch over (data, cfg): each cfg shard holds one guidance branch of the batch.
#: seq over (ring, ulysses), ring outer, matching USP's nesting (ulysses members are neighbours).
#: act_heads: inside attention, heads are split over tensor (Ulysses splits them further, in-kernel).
ACTIVATIONS: Rules = MappingProxyType(
    {
        "batch": ("data", "cfg"),
        # Requests before CFG doubles the batch (latents, sampler state): over data, replicated over cfg.
        "request": "data",
        "seq": ("ring", "ulysses"),
        "act_heads": "tensor",
        "act_mlp": "tensor",
        # PipeFusion (arXiv 2405.14430): each stage's own copy of the latent patches (a leading axis of
        # one entry per stage), and the stale K/V a stage keeps after Ulysses' all_to_all: its heads of
        # the tensor split, then of the ulysses split. The K/V buffers' layer slots follow "layers".
        "stage": "pipefusion",
        "kv_heads": ("tensor", "ulysses"),
    }
)

#: Every weight on every device (sequence, cfg and data parallelism need nothing else).
REPLICATED: Rules = MappingProxyType({})

#: Megatron tensor parallelism: q/k/v and the MLP's first projection are column-parallel (their output
#: features over tensor), the attention-out and MLP-down projections row-parallel (their input features
#: over tensor), followed by one all-reduce each. Embeddings, norms and AdaLN modulation stay
#: replicated: modulation is computed once per step from a [batch, dim] vector, so splitting it would
#: add a collective and save next to nothing.
TENSOR: Rules = MappingProxyType({"heads": "tensor", "mlp": "tensor"})

#: PipeFusion: the stacked block axis is split into contiguous stages, one per pipefusion rank.
PIPEFUSION: Rules = MappingProxyType({"layers": "pipefusion"})


def rules_for(tensor: int = 1, pipefusion: int = 1) -> Rules:
    """The parameter + activation table for a configuration's degrees."""
    table = dict(ACTIVATIONS)
    if tensor > 1:
        table.update(TENSOR)
    if pipefusion > 1:
        table.update(PIPEFUSION)
    return MappingProxyType(table)
