"""The rule table of the decoder-LM text encoders (Qwen2.5-VL, Qwen3, Mistral text models).

The encoder runs once per prompt batch, not in the denoising loop, so its table is its own: the same
logical names as the transformer's, mapped for a causal LM run under ``jax.jit`` (XLA inserts the
collectives). Megatron tensor parallelism as in :data:`sharding_rules.presets.TENSOR`: q/k/v and the MLP's
gate/up projections column-parallel, o and down row-parallel; key/value heads split like query heads
(grouped-query attention keeps each group on the device of its key/value head). The embedding table and
norms stay replicated. Prompts are split over data and cfg (a negative prompt is one more row), tokens
over every sequence-like axis: pipefusion has no stages to run in an encoder, so its devices take a share
of the tokens rather than repeat the work.
"""

from __future__ import annotations

from types import MappingProxyType

from sharding_rules.presets import Rules

__all__ = ["DECODER_LM", "DECODER_LM_TENSOR", "decoder_lm_rules"]

#: Activations (every degree): prompts over (data, cfg), tokens over (pipefusion, ring, ulysses).
DECODER_LM: Rules = MappingProxyType(
    {
        "batch": ("data", "cfg"),
        "seq": ("pipefusion", "ring", "ulysses"),
        "act_heads": "tensor",
        "act_mlp": "tensor",
    }
)

#: Parameters under tensor > 1: heads (query and key/value) and the MLP hidden width over tensor.
DECODER_LM_TENSOR: Rules = MappingProxyType({"heads": "tensor", "mlp": "tensor"})


def decoder_lm_rules(tensor: int = 1) -> Rules:
    """The encoder's parameter + activation table for a tensor degree."""
    table = dict(DECODER_LM)
    if tensor > 1:
        table.update(DECODER_LM_TENSOR)
    return MappingProxyType(table)
