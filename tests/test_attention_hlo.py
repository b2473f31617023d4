"""The compiled attention contains exactly the design's collectives, in count and bytes.

Ulysses: per attention layer each device sends (U-1)/U of four tensors of seq x heads x head_dim / U
elements (q, k, v, output). Ring: R-1 collective-permutes each of the local K and V blocks. Nothing else:
padding masks are computed locally, so odd lengths add no communication. Measured in fp32 because the
CPU backend widens bf16 collectives to f32.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxdit import hlo_stats
from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.attention import sharded_attention
from jaxdit.parallel.layout import SequenceLayout

B, H, D = 1, 8, 16
F32 = 4


def _compile(config, lengths):
    cfg = ParallelConfig(**config)
    mesh = cfg.make_mesh()
    batch = B * cfg.data * cfg.cfg  # B per device after the batch split
    # Inputs already in the padded shard layout, as a model keeps them for a whole step.
    layout = SequenceLayout(tuple(lengths), cfg.sequence_degree)
    shapes = tuple(jax.ShapeDtypeStruct((batch, n, H, D), jnp.float32) for n in layout.padded_lengths)
    fn = jax.jit(sharded_attention(mesh, layout))
    return fn.lower(shapes, shapes, shapes).compile()


def _padded_local_tokens(lengths, shards):
    return sum(-(-n // shards) for n in lengths)


@pytest.mark.parametrize(
    "config",
    [
        dict(ulysses=8),
        dict(ulysses=4, data=2),
        dict(ring=8),
        dict(ring=2, ulysses=4),
        dict(ring=4, ulysses=2),
    ],
    ids=lambda c: "x".join(f"{k}{v}" for k, v in c.items()),
)
@pytest.mark.parametrize("lengths", [(64, 256), (13, 61)], ids=["divisible", "odd"])
def test_collectives_are_exactly_the_designs(config, lengths):
    cfg = ParallelConfig(**config)
    u, r = cfg.ulysses, cfg.ring
    n_local = _padded_local_tokens(lengths, u * r)
    block = B * n_local * H * D * F32  # one of q/k/v/out on one device, before Ulysses' exchange
    stats = hlo_stats.summarize(_compile(config, lengths))

    expect_a2a = 4 if u > 1 else 0
    assert stats["all-to-all"]["count"] == expect_a2a
    assert stats["all-to-all"]["bytes"] == expect_a2a * block
    assert stats["all-to-all"]["bytes_sent"] == pytest.approx(expect_a2a * block * (u - 1) / u)

    # After Ulysses' exchange a ring member holds U shards' tokens for H/U heads: the same bytes.
    expect_permutes = 2 * (r - 1)
    assert stats["collective-permute"]["count"] == expect_permutes
    assert stats["collective-permute"]["bytes"] == expect_permutes * block

    # Nothing else: every other kind hlo_stats knows (send included) is absent.
    for kind in set(hlo_stats.COLLECTIVE_KINDS) - {"all-to-all", "collective-permute"}:
        assert stats[kind]["count"] == 0, f"unexpected {kind}: {stats[kind]}"


def test_tensor_axis_adds_no_attention_communication():
    stats = hlo_stats.summarize(_compile(dict(tensor=2, ring=2, ulysses=2), (13, 61)))
    n_local = _padded_local_tokens((13, 61), 4)
    block = B * n_local * (H // 2) * D * F32  # heads are already split over tensor
    assert stats["all-to-all"]["count"] == 4 and stats["all-to-all"]["bytes"] == 4 * block
    assert stats["collective-permute"]["count"] == 2 and stats["collective-permute"]["bytes"] == 2 * block
    for kind in set(hlo_stats.COLLECTIVE_KINDS) - {"all-to-all", "collective-permute"}:
        assert stats[kind]["count"] == 0, f"unexpected {kind}: {stats[kind]}"
