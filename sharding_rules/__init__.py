"""Logical axis names -> mesh axes, kept as data (one preset per strategy)."""

from sharding_rules.presets import ACTIVATIONS, PIPEFUSION, REPLICATED, TENSOR, Rules, rules_for
from sharding_rules.resolve import logical_to_sharding, logical_to_spec

__all__ = [
    "ACTIVATIONS",
    "PIPEFUSION",
    "REPLICATED",
    "TENSOR",
    "Rules",
    "logical_to_sharding",
    "logical_to_spec",
    "rules_for",
]
