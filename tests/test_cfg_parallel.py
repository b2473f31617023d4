"""CFG parallel: guided prediction equals the single-device formula; one permute is all it sends."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol

from jaxdit import hlo_stats
from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.cfg import combine_branches, guidance, interleave_branches


@pytest.mark.parametrize(
    "degrees", [dict(cfg=2, ulysses=4), dict(data=2, cfg=2, ring=2), dict(data=4, ulysses=2)]
)
def test_combine_matches_formula(degrees):
    rng = np.random.default_rng(0)
    config = ParallelConfig(**degrees)
    batch = 2 * config.data
    uncond, cond = (jnp.asarray(rng.standard_normal((batch, 16, 4)), jnp.float32) for _ in range(2))
    mesh = config.make_mesh()
    out = jax.jit(lambda p: combine_branches(p, 3.5, mesh))(interleave_branches(uncond, cond, config.data))
    tol.check(out, guidance(uncond, cond, 3.5), tol.SHARDED, f"{config.describe()} vs the formula")


def test_cfg_exchanges_exactly_one_prediction():
    config = ParallelConfig(cfg=2, ulysses=4)
    mesh = config.make_mesh()
    shape = jax.ShapeDtypeStruct((2, 64, 16), jnp.float32)
    sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(("data", "cfg"), ("ring", "ulysses"))
    )
    fn = jax.jit(lambda p: combine_branches(p, 5.0, mesh, seq_sharded=True), in_shardings=sharding)
    compiled = fn.lower(shape).compile()
    stats = hlo_stats.summarize(compiled)
    assert stats["collective-permute"]["count"] == 1
    # One branch's prediction, of this device's sequence shard (64 tokens over ulysses=4).
    assert stats["collective-permute"]["bytes"] == 64 // 4 * 16 * 4
    assert stats["total"]["count"] == 1
