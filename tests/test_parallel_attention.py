"""Every sequence-parallel strategy equals unsharded attention (fp32: tolerance.SHARDED; bf16 see below)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.attention import parallel_attention
from jaxdit.parallel.local_attention import local_attention, merge_partials, reference_attention

# Each configuration uses all 8 emulated devices.
CONFIGS = {
    "ulysses2": dict(ulysses=2, data=4),
    "ulysses4": dict(ulysses=4, data=2),
    "ulysses8": dict(ulysses=8),
    "ring2": dict(ring=2, data=4),
    "ring4": dict(ring=4, data=2),
    "ring8": dict(ring=8),
    "ring2_ulysses4": dict(ring=2, ulysses=4),
    "ring4_ulysses2": dict(ring=4, ulysses=2),
    "cfg2_ulysses4": dict(cfg=2, ulysses=4),
    "data2_ring2_ulysses2": dict(data=2, ring=2, ulysses=2),
    "tensor2_ring2_ulysses2": dict(tensor=2, ring=2, ulysses=2),
    "tensor8": dict(tensor=8),
    "pipefusion2_ulysses4": dict(pipefusion=2, ulysses=4),
}


def _groups(rng, batch, lengths, heads, head_dim, dtype=jnp.float32):
    make = lambda n: jnp.asarray(rng.standard_normal((batch, n, heads, head_dim)), jnp.float32).astype(dtype)
    return [make(n) for n in lengths], [make(n) for n in lengths], [make(n) for n in lengths]


def _reference(q, k, v, mask=None):
    cat = lambda xs: jnp.concatenate([x.astype(jnp.float32) for x in xs], axis=1)
    m = None if mask is None else jnp.concatenate(mask, axis=1)
    return reference_attention(cat(q), cat(k), cat(v), m)


def _run(q, k, v, config, **kw):
    mesh = ParallelConfig(**config).make_mesh()
    fn = jax.jit(lambda q, k, v: parallel_attention(q, k, v, mesh, **kw))
    out = fn(q, k, v)
    return jnp.concatenate([o.astype(jnp.float32) for o in out], axis=1) if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_strategy_matches_unsharded_fp32(name):
    rng = np.random.default_rng(0)
    # Two token groups (text + image) whose lengths no degree divides: 13 and 61 tokens.
    q, k, v = _groups(rng, batch=8, lengths=(13, 61), heads=8, head_dim=16)
    out = _run(tuple(q), tuple(k), tuple(v), CONFIGS[name])
    tol.check(out, _reference(q, k, v), tol.SHARDED, name)


@pytest.mark.parametrize("name", ["ring8", "ring2_ulysses4"])
def test_strategy_bf16(name):
    # bf16 tolerance: both the sharded and the single-device kernel accumulate in fp32 and round the
    # output to bf16 once; the probabilities are rounded to bf16 before the PV matmul, and block
    # boundaries (which differ between strategies) change the running max they are scaled by. Each
    # contributes at most one bf16 ulp (2^-8 relative) at the output's scale, so both must be within
    # 2 ulps of the fp32 reference computed from the same bf16 inputs. The test also checks the bound
    # is tight enough to mean something: the single-device bf16 result is held to it as well.
    rng = np.random.default_rng(1)
    q, k, v = _groups(rng, batch=2, lengths=(13, 61), heads=8, head_dim=16, dtype=jnp.bfloat16)
    ref = _reference(q, k, v)
    bound = 2 * 2.0**-8 * float(jnp.abs(ref).max())
    mesh1 = ParallelConfig().make_mesh(jax.devices()[:1])
    single = jnp.concatenate(
        [o.astype(jnp.float32) for o in parallel_attention(tuple(q), tuple(k), tuple(v), mesh1)], axis=1
    )
    sharded = _run(tuple(q), tuple(k), tuple(v), CONFIGS[name])
    assert float(jnp.abs(single - ref).max()) <= bound
    assert float(jnp.abs(sharded - ref).max()) <= bound, (
        f"{name}: {float(jnp.abs(sharded - ref).max())} > {bound}"
    )


def test_single_group_and_user_key_mask():
    rng = np.random.default_rng(2)
    q, k, v = _groups(rng, batch=2, lengths=(45,), heads=4, head_dim=8)
    mask = [jnp.asarray(rng.random((2, 45)) > 0.4)]
    out = _run(q[0], k[0], v[0], dict(ring=2, ulysses=4), key_mask=mask[0])
    assert out.shape == (2, 45, 4, 8)
    tol.check(out, _reference(q, k, v, mask), tol.SHARDED, "ring2 x ulysses4, one group, user key mask")


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    config=st.sampled_from(["ulysses8", "ring4_ulysses2", "ring8", "data2_ring2_ulysses2"]),
    head_dim=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(lengths, config, head_dim, seed):
    rng = np.random.default_rng(seed)
    batch = 2 if "data2" in config else 1
    q, k, v = _groups(rng, batch=batch, lengths=tuple(lengths), heads=8, head_dim=head_dim)
    out = _run(tuple(q), tuple(k), tuple(v), CONFIGS[config])
    tol.check(out, _reference(q, k, v), tol.SHARDED, f"{config}, lengths {lengths}")


def test_local_attention_blockwise_and_fully_masked_rows():
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 37, 3, 8)), jnp.float32) for _ in range(3))
    valid = jnp.asarray(rng.random((2, 37)) > 0.3)
    out, lse = local_attention(q, k, v, valid, block_k=5, block_q=8)  # 8 key tiles x 5 query tiles
    tol.check(out, reference_attention(q, k, v, valid), tol.SHARDED, "blockwise kernel vs full softmax")
    scores = jnp.einsum("bqhd,bkhd->bqhk", q, k) / np.sqrt(8)
    ref_lse = jax.nn.logsumexp(jnp.where(valid[:, None, None, :], scores, -jnp.inf), axis=-1)
    tol.check(lse, ref_lse, tol.SHARDED, "blockwise kernel's log-sum-exp")
    none_valid = jnp.zeros((2, 37), bool)
    out0, lse0 = local_attention(q, k, v, none_valid, block_k=5)
    assert bool(jnp.all(out0 == 0)) and bool(jnp.all(jnp.isneginf(lse0)))
    # Merging with an empty partial is the identity.
    merged, merged_lse = merge_partials(out, lse, out0, lse0)
    assert float(jnp.abs(merged - out).max()) == 0 and float(jnp.abs(merged_lse - lse).max()) == 0


def test_heads_that_do_not_split_are_rejected_before_compiling():
    rng = np.random.default_rng(4)
    q, k, v = _groups(rng, batch=1, lengths=(16,), heads=6, head_dim=4)
    mesh = ParallelConfig(ulysses=4, ring=2).make_mesh()
    with pytest.raises(ValueError, match=r"6 heads cannot be split over ulysses=4 x tensor=1.*1, 2, 3, 6"):
        parallel_attention(q[0], k[0], v[0], mesh)


def test_batch_that_does_not_split_is_rejected():
    rng = np.random.default_rng(5)
    q, k, v = _groups(rng, batch=3, lengths=(16,), heads=4, head_dim=4)
    mesh = ParallelConfig(cfg=2, ulysses=4).make_mesh()
    with pytest.raises(ValueError, match="batch 3 does not split over data=1 x cfg=2"):
        parallel_attention(q[0], k[0], v[0], mesh)


def test_mismatched_groups_are_rejected():
    rng = np.random.default_rng(6)
    q, k, v = _groups(rng, batch=1, lengths=(8, 8), heads=4, head_dim=4)
    mesh = ParallelConfig(ulysses=4, ring=2).make_mesh()
    with pytest.raises(ValueError, match="token groups"):
        parallel_attention(tuple(q), tuple(k[:1]), tuple(v), mesh)
