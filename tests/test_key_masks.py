"""Per-sample key masks (real prompt lengths) through every strategy and kernel, against the unmasked
computation on the real keys only.

The reference never sees a mask: for batch element b it is plain softmax attention (or the unmasked
model) over that element's real keys, the text cut to its length L_b. The masked runs keep every prompt
padded to T tokens in one batch, on meshes whose degrees divide neither T nor the image length (so the
layout's padding and the prompt masks meet in one mask), with one element per ring block length that
leaves whole K/V blocks masked (its prompt is shorter than a shard). XLA everywhere; Triton and splash in
Pallas interpret mode; cuDNN through the stand-in of ``test_kernels_cudnn`` (its lengths path). Run with
``-s`` to see the errors.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
from flax import nnx
from test_kernels_cudnn import STAND_IN

from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux
from jaxdit.parallel import pipefusion
from jaxdit.parallel.attention import parallel_attention
from jaxdit.parallel.kernels import cudnn
from jaxdit.parallel.local_attention import reference_attention

TEXT, IMAGE = 13, 21
#: Real text tokens of the batch's four elements: full, short, one token (every ring block past the first
#: holds no real text), medium.
LENGTHS = (13, 5, 1, 9)

CONFIGS = {
    "ulysses4": dict(ulysses=4, data=2),
    "ring4": dict(ring=4, data=2),
    "ring2_ulysses2": dict(ring=2, ulysses=2, data=2),
    # Each cfg branch on its own devices with its own prompt lengths (negative and positive differ).
    "cfg2_ring2_ulysses2": dict(cfg=2, ring=2, ulysses=2),
    "tensor2_ring2_ulysses2": dict(tensor=2, ring=2, ulysses=2),
}


def _text_mask(lengths, t=TEXT):
    return np.arange(t)[None, :] < np.asarray(lengths)[:, None]


@functools.cache
def _groups(heads=8, head_dim=16):
    rng = np.random.default_rng(0)
    make = lambda n: jnp.asarray(rng.standard_normal((len(LENGTHS), n, heads, head_dim)), jnp.float32)
    return tuple(tuple(make(n) for n in (TEXT, IMAGE)) for _ in range(3))  # q, k, v: (text, image) each


@functools.cache
def _reference(dtype=jnp.float32):
    """Per element: attention of every query over its real keys only (the text cut to L_b), no mask; from
    the inputs rounded to ``dtype``, computed in fp32."""
    q, k, v = (tuple(x.astype(dtype).astype(jnp.float32) for x in xs) for xs in _groups())
    outs = []
    for b, n in enumerate(LENGTHS):
        real = lambda x, b=b, n=n: jnp.concatenate([x[0][b : b + 1, :n], x[1][b : b + 1]], axis=1)
        queries = jnp.concatenate([q[0][b : b + 1], q[1][b : b + 1]], axis=1)
        outs.append(reference_attention(queries, real(k), real(v)))
    return jnp.concatenate(outs, axis=0)


def _masked(config, **kernel):
    q, k, v = _groups()
    mesh = ParallelConfig(**config).make_mesh()
    mask = (jnp.asarray(_text_mask(LENGTHS)), None)  # image tokens: all real
    fn = jax.jit(lambda q, k, v, m: parallel_attention(q, k, v, mesh, key_mask=(m, None), **kernel))
    out = fn(q, k, v, mask[0])
    return jnp.concatenate([o.astype(jnp.float32) for o in out], axis=1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_masked_prompts_match_real_keys_xla(name):
    out = _masked(CONFIGS[name])
    assert bool(jnp.all(jnp.isfinite(out)))
    tol.check(out, _reference(), tol.SHARDED, f"xla {name}, prompt lengths {LENGTHS}")


PALLAS = [("triton", "ring2_ulysses2"), ("triton", "cfg2_ring2_ulysses2"), ("splash", "ring4")]


@pytest.mark.parametrize("backend,name", PALLAS, ids=[f"{b}-{n}" for b, n in PALLAS])
def test_masked_prompts_match_real_keys_pallas_interpret(backend, name):
    out = _masked(CONFIGS[name], backend=backend, interpret=True)
    assert bool(jnp.all(jnp.isfinite(out)))
    tol.check(out, _reference(), tol.KERNEL, f"{backend} (interpret) {name}, prompt lengths {LENGTHS}")


def test_masked_prompts_through_cudnn_lengths(monkeypatch):
    """cuDNN takes a mask only as lengths: the adapter puts each element's real keys first."""
    monkeypatch.setattr(cudnn, "load", lambda: STAND_IN)
    q, k, v = _groups()
    bf16 = lambda xs: tuple(x.astype(jnp.bfloat16) for x in xs)
    mesh = ParallelConfig(ring=4, data=2).make_mesh()
    kernel = dict(backend="cudnn", platform="cuda")
    fn = jax.jit(lambda q, k, v, m: parallel_attention(q, k, v, mesh, key_mask=(m, None), **kernel))
    out = fn(bf16(q), bf16(k), bf16(v), jnp.asarray(_text_mask(LENGTHS)))
    out = jnp.concatenate([o.astype(jnp.float32) for o in out], axis=1)
    ref = _reference(jnp.bfloat16)
    tol.check(out, ref, tol.KERNEL_BF16, f"cudnn (stand-in) ring4, prompt lengths {LENGTHS}")


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_fully_masked_ring_blocks_stay_finite(backend):
    """One group of 24 keys on ring4: element 0 has 5 real keys, so 3 of its 4 K/V blocks are all masked;
    the online softmax and Ring's merge must give exactly the attention over those 5 keys, no NaN."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 24, 4, 8)), jnp.float32) for _ in range(3))
    lengths = (5, 24)
    mesh = ParallelConfig(ring=4, data=2).make_mesh()
    kernel = dict(backend=backend, interpret=True) if backend != "xla" else {}
    mask = jnp.asarray(_text_mask(lengths, 24))
    out = jax.jit(lambda q, k, v, m: parallel_attention(q, k, v, mesh, key_mask=m, **kernel))(q, k, v, mask)
    ref = jnp.concatenate(
        [reference_attention(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n]) for b, n in enumerate(lengths)]
    )
    assert bool(jnp.all(jnp.isfinite(out)))
    tol.check(out, ref, tol.KERNEL, f"{backend} ring4, 3 of 4 blocks fully masked")


def test_a_mask_cannot_unmask_the_layouts_padding():
    """True at padding positions of a caller's mask does not make padding keys real (one mask)."""
    from jaxdit.parallel.attention import gather_key_mask
    from jaxdit.parallel.layout import SequenceLayout

    layout = SequenceLayout((3, 5), 1)  # no padding on one shard: the mask passes as is
    m = jnp.asarray([[True, False, True, True, True, True, False, True]])
    assert np.array_equal(gather_key_mask(m, layout), m)
    layout = SequenceLayout((3, 5), 2)  # local (2, 3): shard 1 holds text 2 + pad, image 3..4 + pad
    mesh = ParallelConfig(ring=2, data=4).make_mesh()  # data: replicated here
    from jax.sharding import PartitionSpec as P

    gathered = jax.shard_map(
        lambda x: gather_key_mask(x, layout),
        mesh=mesh,
        in_specs=P(None, "ring"),
        out_specs=P(),
        check_vma=False,
    )(jnp.ones((1, 10), bool))
    assert np.array_equal(np.asarray(gathered)[0], layout.all_keys_valid())
    assert layout.all_keys_valid().tolist() == [1, 1, 1, 1, 1, 1, 0, 1, 1, 0]


# ------------------------------------------------------------------------------ PipeFusion's stale K/V


def test_pipefusion_patch_attention_carries_per_sample_masks():
    """patch_attention over fresh K/V (one ring block per member) and a stale buffer, both with a mask per
    batch element, equals attention over the union of their real keys."""
    rng = np.random.default_rng(2)
    b, n, h, d, stale_len = 2, 6, 4, 8, 10
    q, k, v = (jnp.asarray(rng.standard_normal((b, 2 * n, h, d)), jnp.float32) for _ in range(3))
    kb, vb = (jnp.asarray(rng.standard_normal((b, stale_len, h, d)), jnp.float32) for _ in range(2))
    fresh_valid = np.ones((2, b, n), bool)  # [ring member, batch, keys]
    fresh_valid[1, 0] = False  # element 0: member 1's whole block masked
    fresh_valid[0, 1, 4:] = False
    stale_valid = np.ones((b, stale_len), bool)
    stale_valid[0, 3:] = False
    stale_valid[1, :7] = False
    mesh = ParallelConfig(ring=2, data=4).make_mesh()  # data: replicated here
    from jax.sharding import PartitionSpec as P

    def local(q, k, v, kb, vb):
        out, _, _ = pipefusion.patch_attention(
            q,
            k,
            v,
            ring=2,
            ulysses=1,
            fresh_valid=jnp.asarray(fresh_valid),
            stale=(kb, vb, jnp.asarray(stale_valid)),
        )
        return out

    seq = P(None, "ring")
    fn = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, P(), P()), out_specs=seq, check_vma=False)
    out = jax.jit(fn)(q, k, v, kb, vb)
    fresh_keys = np.concatenate([fresh_valid[0], fresh_valid[1]], axis=1)  # [b, 2n] in ring order
    ref = []
    for e in range(b):
        keep = lambda x, m, e=e: x[e : e + 1, np.flatnonzero(m[e])]
        ks = jnp.concatenate([keep(k, fresh_keys), keep(kb, stale_valid)], axis=1)
        vs = jnp.concatenate([keep(v, fresh_keys), keep(vb, stale_valid)], axis=1)
        ref.append(reference_attention(q[e : e + 1], ks, vs))
    tol.check(out, jnp.concatenate(ref), tol.SHARDED, "patch_attention, per-sample fresh and stale masks")


# ------------------------------------------------------------------------------ a FLUX model on a mesh

FLUX_CONFIG = flux.FluxConfig(
    in_channels=8,
    out_channels=8,
    vec_in_dim=8,
    context_in_dim=16,
    hidden_size=64,
    num_heads=8,
    depth=1,
    depth_single_blocks=1,
    axes_dim=(2, 2, 4),
)


@functools.cache
def _flux_case():
    model = flux.FluxTransformer(FLUX_CONFIG, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(4)
    b = len(LENGTHS)
    x = dict(
        hidden_states=rng.standard_normal((b, IMAGE, 8)).astype(np.float32),
        encoder_hidden_states=rng.standard_normal((b, TEXT, 16)).astype(np.float32),
        pooled_projections=rng.standard_normal((b, 8)).astype(np.float32),
        timestep=rng.uniform(0.1, 1.0, b).astype(np.float32),
        img_ids=np.stack([np.zeros(IMAGE), np.arange(IMAGE) // 7, np.arange(IMAGE) % 7], 1).astype(
            np.float32
        ),
        txt_ids=np.zeros((TEXT, 3), np.float32),
    )
    # The unmasked model, one element at a time, on its real text tokens only.
    single = flux.sharded(model, ParallelConfig().make_mesh(jax.devices()[:1]), compiler_options=QUICK)
    ref = []
    for e, n in enumerate(LENGTHS):
        one = {
            k: (a[e : e + 1] if a.shape[0] == b and k not in ("img_ids", "txt_ids") else a)
            for k, a in x.items()
        }
        one["encoder_hidden_states"] = one["encoder_hidden_states"][:, :n]
        one["txt_ids"] = one["txt_ids"][:n]
        ref.append(np.asarray(single(**one)))
    return model, x, np.concatenate(ref)


#: The model's attention calls go through ShardContext.attention (the strategies and kernels are covered
#: above): CFG branches with their own lengths, and tensor x USP in Pallas interpret mode.
FLUX_RUNS = [
    ("cfg2_ring2_ulysses2", {}),
    ("tensor2_ring2_ulysses2", dict(backend="triton", interpret=True)),
]
QUICK = {"xla_backend_optimization_level": 0}


@pytest.mark.parametrize(
    "name,kernel", FLUX_RUNS, ids=[f"{n}-{k.get('backend', 'xla')}" for n, k in FLUX_RUNS]
)
def test_flux_with_masked_prompts_matches_the_unmasked_model_on_real_tokens(name, kernel):
    model, x, ref = _flux_case()
    mesh = ParallelConfig(**CONFIGS[name]).make_mesh()
    forward = flux.sharded(model, mesh, kernel=kernel, compiler_options=QUICK)
    out = forward(**x, encoder_attention_mask=_text_mask(LENGTHS))
    bound = tol.SHARDED if not kernel else tol.KERNEL
    tol.check(out, ref, bound, f"FLUX {name} {kernel.get('backend', 'xla')}, prompt lengths {LENGTHS}")
    # Without the mask the padded prompt tokens are attended (diffusers' FLUX): a different result
    # (measured 9.9e-5, ~100x the bound: the random model's attention is nearly uniform).
    assert tol.max_error(forward(**x), ref) > 20 * bound.allowed(float(np.abs(ref).max()))
