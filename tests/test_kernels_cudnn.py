"""The cuDNN adapter's own logic, with a stand-in for jax's private cuDNN call (no GPU here).

The stand-in has the private function's argument and result contract (jax
``_src/cudnn/fused_attention_stablehlo.py``): the same signature, the same refusals (fp16/bf16 only,
head_dim a multiple of 8 up to 256, int32 [B] lengths for the PADDING mask, BTNH layout), padding only as
lengths (key j is seen iff j < kv_seqlen[b], query rows past q_seqlen are zero), output in the query's
dtype and the log-sum-exp as [B, N, T] fp32. Rows with no valid key come back NaN, as a division by a
zero sum would give, so the adapter has to clear them itself. The stand-in computes in fp32, so what is
left to test is the adapter: valid keys first, the lengths, the LSE transpose, empty rows, and that Ring
attention merges its partials (over 8 blocks, some all padding).
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol

from jaxdit.mesh import ParallelConfig
from jaxdit.parallel.attention import parallel_attention
from jaxdit.parallel.kernels import cudnn
from jaxdit.parallel.local_attention import local_attention, reference_attention

MaskType = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo").MaskType


def cudnn_stand_in(
    query,
    key,
    value,
    bias=None,
    mask=None,
    q_seqlen=None,
    kv_seqlen=None,
    q_offsets=None,
    kv_offsets=None,
    fp8_params=None,
    *,
    scale=1.0,
    mask_type=MaskType.NO_MASK,
    seed=42,
    dropout_rate=0.0,
    qkv_layout="BTNH",
    sliding_window_length=None,
    use_fp8=False,
    return_residual=False,
):
    if qkv_layout != "BTNH" or query.ndim != 4:
        raise ValueError(f"stand-in: layout {qkv_layout}, rank {query.ndim}")
    if query.dtype not in (jnp.float16, jnp.bfloat16) or not (query.dtype == key.dtype == value.dtype):
        raise NotImplementedError(f"Q must be fp16/bf16, got {query.dtype}, {key.dtype}, {value.dtype}")
    b, t, n, h = query.shape
    s = key.shape[1]
    if key.shape != value.shape or key.shape[0] != b or key.shape[2:] != (n, h):
        raise ValueError(f"stand-in: shapes {query.shape}, {key.shape}, {value.shape}")
    if h % 8 or h > 256:
        raise NotImplementedError(f"The head dim must be <= 256 and a multiple of 8, but got {h}.")
    if bias is not None or mask is not None or q_offsets is not None or use_fp8 or dropout_rate:
        raise ValueError("stand-in: the adapter passes no bias, mask, offsets, fp8 or dropout")
    scores = jnp.einsum("btnh,bsnh->bnts", query, key, preferred_element_type=jnp.float32) * scale
    if mask_type == MaskType.PADDING:
        for name, lengths in (("q_seqlen", q_seqlen), ("kv_seqlen", kv_seqlen)):
            if lengths is None or lengths.dtype != jnp.int32 or lengths.shape != (b,):
                raise ValueError(f"{name} must be int32 [B], got {lengths}")
        key_seen = jnp.arange(s)[None, :] < kv_seqlen[:, None]  # [B, S]: the first kv_seqlen keys
        query_real = jnp.arange(t)[None, :] < q_seqlen[:, None]  # [B, T]
    elif mask_type == MaskType.NO_MASK:
        key_seen, query_real = jnp.ones((b, s), bool), jnp.ones((b, t), bool)
    else:
        raise ValueError(f"stand-in: mask_type {mask_type}")
    scores = jnp.where(key_seen[:, None, None, :], scores, -jnp.inf)
    top = scores.max(axis=-1, keepdims=True)
    weights = jnp.exp(scores - top)  # NaN for a row with no key seen: -inf - -inf
    total = weights.sum(axis=-1, keepdims=True)
    out = jnp.einsum("bnts,bsnh->btnh", weights / total, value.astype(jnp.float32))
    out = jnp.where(query_real[:, :, None, None], out, 0.0).astype(query.dtype)
    lse = (top + jnp.log(total))[..., 0]  # [B, N, T] fp32
    return (out, lse) if return_residual else out


STAND_IN = (cudnn_stand_in, MaskType)


def test_stand_in_has_the_private_functions_signature():
    from jax._src.cudnn import fused_attention_stablehlo as fa

    real = inspect.signature(fa.dot_product_attention).parameters
    ours = inspect.signature(cudnn_stand_in).parameters
    used = [
        "query",
        "key",
        "value",
        "bias",
        "mask",
        "q_seqlen",
        "kv_seqlen",
        "scale",
        "mask_type",
        "qkv_layout",
    ]
    for name in [*used, "return_residual"]:
        assert real[name].kind == ours[name].kind, name
    assert list(real)[:7] == list(ours)[:7]


def test_stand_in_refuses_what_cudnn_refuses():
    q = jnp.zeros((1, 4, 2, 8), jnp.float32)
    with pytest.raises(NotImplementedError, match="fp16/bf16"):
        cudnn_stand_in(q, q, q, return_residual=True)
    q = jnp.zeros((1, 4, 2, 12), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        cudnn_stand_in(q, q, q, return_residual=True)


def test_valid_keys_come_first_in_order():
    k = jnp.arange(2 * 6, dtype=jnp.float32).reshape(2, 6, 1, 1)
    valid = jnp.asarray([[False, True, False, True, True, False], [True] * 6])
    k2, v2, lengths = cudnn.valid_keys_first(k, -k, valid)
    assert lengths.tolist() == [3, 6] and lengths.dtype == jnp.int32
    assert k2[0, :3, 0, 0].tolist() == [1.0, 3.0, 4.0]  # the valid keys, in their order
    assert bool(jnp.all(k2[1] == k[1])) and bool(jnp.all(v2 == -k2))


def _check(name, out, lse, q, k, v, valid):
    f32 = lambda x: x.astype(jnp.float32)
    ref = reference_attention(f32(q), f32(k), f32(v), valid)
    scores = jnp.einsum("bqhd,bkhd->bqhk", f32(q), f32(k)) / np.sqrt(q.shape[-1])
    ref_lse = jax.nn.logsumexp(jnp.where(valid[:, None, None, :], scores, -jnp.inf), axis=-1)
    real = np.asarray(valid.any(axis=1))
    # Out is rounded to bf16 once (half an ulp of its scale); the LSE is fp32 throughout.
    tol.check(f32(out[real]), ref[real], tol.BF16_ROUNDED_ONCE, f"{name}: out")
    tol.check(lse[real], ref_lse[real], tol.KERNEL, f"{name}: lse")
    assert lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
    assert bool(jnp.all(out[~real] == 0)) and bool(jnp.all(jnp.isneginf(lse[~real])))


def test_adapter_with_padding_in_the_middle_and_empty_rows():
    rng = np.random.default_rng(0)
    make = lambda t: jnp.asarray(rng.standard_normal((3, t, 4, 16)), jnp.bfloat16)
    q, k, v = make(21), make(37), make(37)
    valid = rng.random((3, 37)) > 0.3
    valid[0, 10:20] = False  # a run of padding in the middle, as [text_r; image_r] has
    valid[1] = False  # no valid key: out 0, lse -inf (the stand-in returns NaN there)
    valid = jnp.asarray(valid)
    adapter = jax.jit(lambda q, k, v, m: cudnn.attention(q, k, v, m, scale=16**-0.5, fused=STAND_IN))
    out, lse = adapter(q, k, v, valid)
    assert out.dtype == jnp.bfloat16
    _check("cudnn adapter (stand-in), key mask", out, lse, q, k, v, valid)
    out, lse = adapter(q, k, v, None)
    _check("cudnn adapter (stand-in), no mask", out, lse, q, k, v, jnp.ones((3, 37), bool))


@pytest.fixture
def cudnn_is_the_stand_in(monkeypatch):
    """local_attention chooses cuDNN (platform "cuda") and gets the stand-in; returns its trace count."""
    traced = []

    def counting(*args, **kwargs):
        traced.append(kwargs["mask_type"])
        return cudnn_stand_in(*args, **kwargs)

    monkeypatch.setattr(cudnn, "load", lambda: (counting, MaskType))
    return traced


def test_local_attention_chooses_cudnn_for_bf16_on_cuda(cudnn_is_the_stand_in):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 9, 2, 8)), jnp.bfloat16)
    valid = jnp.asarray(rng.random((1, 9)) > 0.3)
    fn = jax.jit(lambda q, m: local_attention(q, q, q, m, platform="cuda", out_dtype=jnp.float32))
    out, lse = fn(q, valid)
    assert cudnn_is_the_stand_in == [MaskType.PADDING]  # auto chose cuDNN, once, at trace time
    _check("cudnn via local_attention (auto on cuda)", out, lse, q, q, q, valid)


def test_ring_merges_cudnn_partials(cudnn_is_the_stand_in):
    # Lengths (2, 9) on 8 shards: padding in the middle of shards and shards with no real token.
    rng = np.random.default_rng(2)
    make = lambda n: jnp.asarray(rng.standard_normal((1, n, 8, 16)), jnp.bfloat16)
    lengths = (2, 9)
    q, k, v = (tuple(make(n) for n in lengths) for _ in range(3))
    config = dict(ring=8)
    mesh = ParallelConfig(**config).make_mesh()
    kernel = dict(backend="cudnn", platform="cuda")
    out = jnp.concatenate(
        jax.jit(lambda q, k, v: parallel_attention(q, k, v, mesh, **kernel))(q, k, v), axis=1
    )
    cat = lambda xs: jnp.concatenate([x.astype(jnp.float32) for x in xs], axis=1)
    ref = reference_attention(cat(q), cat(k), cat(v))
    # Each partial is rounded to bf16 by the kernel, then merged in fp32 and rounded once more: 2 roundings.
    tol.check(
        out.astype(jnp.float32), ref, tol.KERNEL_BF16, f"cudnn (stand-in) {config} vs the unsharded reference"
    )
    assert cudnn_is_the_stand_in  # the strategies' local attention went through the adapter
