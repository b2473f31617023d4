"""cuDNN's fused attention on NVIDIA GPUs, with its log-sum-exp in fp32.

The public ``jax.nn.dot_product_attention(implementation="cudnn", return_residual=True)`` casts the
log-sum-exp to the output's dtype (bf16), too coarse to merge Ring attention's partial results. jax's own
entry point one level down keeps it in fp32 (MaxText's ``cudnn_flash_jax`` path calls it too):

    jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(
        query, key, value, bias, mask, q_seqlen, kv_seqlen, *, scale, mask_type, qkv_layout="BTNH",
        return_residual=True) -> (out [B, T, N, H] in query's dtype, lse [B, N, T] fp32, natural log)

It is private, so :func:`load` imports it at trace time and says why when it cannot (a test pins it).

cuDNN takes padding only as lengths (``mask_type=PADDING`` with ``q_seqlen`` / ``kv_seqlen``): the valid
keys must come first. The shard-major layout has padding in the middle of a shard (``[text_r; image_r]``,
each padded) and Ring hands over other shards' blocks, so the adapter reorders the keys of each batch
element, valid ones first in their original order (a stable sort of the mask), and passes their count as
``kv_seqlen``. Softmax attention does not depend on the order of its keys, so this is exact. Every query is
real to the kernel (``q_seqlen`` = Tq); queries the caller pads are dropped by the caller.

Limits (checked before tracing, see :func:`unsupported`): float16/bfloat16 only; head_dim a multiple of 8,
at most 256 on Hopper and newer (128 before); an NVIDIA GPU with cuDNN present.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxdit.parallel.kernels.contract import clear_empty_rows

#: Where jax keeps the fp32-LSE entry point (private: may move between releases).
PRIVATE_MODULE = "jax._src.cudnn.fused_attention_stablehlo"


#: The private function's parameters the adapter relies on: the first seven, positional in this order,
#: and the keyword-only ones it passes.
POSITIONAL = ("query", "key", "value", "bias", "mask", "q_seqlen", "kv_seqlen")
KEYWORD_ONLY = ("scale", "mask_type", "qkv_layout", "return_residual")


def check_contract(module) -> None:
    """Raise RuntimeError unless ``module`` (jax's private cuDNN attention module) still has the function,
    parameters and mask types the adapter calls. Checked once per process, before the first use, so that a jax release that
    changed them falls back to another kernel with a warning instead of failing inside a trace; the test
    that pins them fails loudly, naming the jax version."""
    import inspect

    try:
        params = inspect.signature(module.dot_product_attention).parameters
        members = set(module.MaskType.__members__)
        probe = module.check_cudnn_version
    except (AttributeError, TypeError, ValueError) as e:
        raise RuntimeError(
            f"jax {jax.__version__}: {PRIVATE_MODULE} changed ({type(e).__name__}: {e})"
        ) from e
    problems = [] if callable(probe) else ["check_cudnn_version is not callable"]
    if tuple(params)[: len(POSITIONAL)] != POSITIONAL:
        problems.append(f"positional parameters {tuple(params)[: len(POSITIONAL)]}, expected {POSITIONAL}")
    for name in KEYWORD_ONLY:
        if name not in params or params[name].kind is not inspect.Parameter.KEYWORD_ONLY:
            problems.append(f"no keyword-only {name!r}")
    if not {"NO_MASK", "PADDING"} <= members:
        problems.append(f"MaskType has {sorted(members)}, not NO_MASK and PADDING")
    if problems:
        raise RuntimeError(
            f"jax {jax.__version__}: {PRIVATE_MODULE}.dot_product_attention changed: {'; '.join(problems)}"
        )


@functools.cache
def _private_module():
    """jax's private module, imported and its contract checked once (RuntimeError: why not usable)."""
    import importlib

    try:
        module = importlib.import_module(PRIVATE_MODULE)
    except ImportError as e:
        raise RuntimeError(f"jax {jax.__version__} has no {PRIVATE_MODULE} ({e})") from e
    check_contract(module)
    return module


def load() -> tuple[Callable, type]:
    """jax's private cuDNN attention and its ``MaskType`` enum, once cuDNN is known to be present.

    Raises RuntimeError naming the reason (the private function moved or changed in this jax version, or
    cuDNN is not detected), which the backend choice turns into a fallback with a warning.
    """
    module = _private_module()
    try:
        module.check_cudnn_version()
    except Exception as e:  # RuntimeError("cuDNN is not detected.") on hosts without cuDNN
        raise RuntimeError(f"cuDNN is unavailable: {e}") from e
    return module.dot_product_attention, module.MaskType


@functools.cache
def max_head_dim() -> int:
    """cuDNN's head_dim limit on the local GPU: 256 on Hopper (compute capability 9.0) and newer, else 128.
    256 when no GPU can be asked (lowering for a GPU from another machine)."""
    try:
        capability = jax.devices("gpu")[0].compute_capability
    except (RuntimeError, AttributeError, IndexError):
        return 256
    return 256 if tuple(int(x) for x in str(capability).split(".")) >= (9, 0) else 128


def limits(dtype, head_dim: int, max_head: int | None = None) -> str | None:
    """Why cuDNN cannot serve this dtype / head dimension (its limits), or None. ``max_head``: the head
    dimension limit of the GPU judged for (default: the local GPU's, :func:`max_head_dim`, which asks jax
    for its devices and so starts its backend)."""
    if jnp.dtype(dtype) not in (jnp.float16, jnp.bfloat16):
        return f"cuDNN attention takes float16/bfloat16, not {jnp.dtype(dtype).name}"
    limit = max_head_dim() if max_head is None else max_head
    if head_dim % 8 or head_dim > limit:
        return f"cuDNN attention takes head_dim a multiple of 8 up to {limit}, not {head_dim}"
    return None


def missing() -> str | None:
    """Why cuDNN cannot run on this host (not detected, jax's private entry point moved, or a tiny fused
    call failed to compile or run on the local GPU: :func:`probe_failure`), or None."""
    try:
        load()
    except RuntimeError as e:
        return str(e)
    return probe_failure()


def _local_gpu() -> bool:
    """Whether this process has an NVIDIA GPU to compile for (False when lowering for one from a CPU)."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


#: The probe's call: q = k = v [1, 128, 1, 64] bf16, no mask (the smallest shape cuDNN's kernel takes).
PROBE_SHAPE = (1, 128, 1, 64)


def _compile_tiny() -> None:
    """Compile and run one tiny fused call on the local GPU; raise when cuDNN fails (jax issue 32430:
    cuDNN's fused attention failing to compile under the CUDA 13 plugin). Lowered and compiled ahead of
    time from shapes and run on host arrays, so it is safe to call while another program is traced."""
    import numpy as np

    spec = jax.ShapeDtypeStruct(PROBE_SHAPE, jnp.bfloat16)
    compiled = jax.jit(lambda q: attention(q, q, q, None, scale=0.125)).lower(spec).compile()
    x = np.random.default_rng(0).standard_normal(PROBE_SHAPE).astype(jnp.bfloat16)
    out, lse = jax.block_until_ready(compiled(x))
    if not (np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(np.asarray(lse)).all()):
        raise RuntimeError("the probe's output or log-sum-exp is not finite")


@functools.cache
def probe_failure() -> str | None:
    """Why a tiny cuDNN fused-attention call fails on the local GPU, or None (also None with no local
    GPU: lowering for one from a CPU host compiles nothing). Once per process: the first trace that asks
    for cuDNN pays one small compile, and ``auto`` then falls back to the Triton kernel with one warning."""
    if not _local_gpu():
        return None
    try:
        _compile_tiny()
    except Exception as e:  # noqa: BLE001 - any failure of cuDNN's compile or run is a reason to fall back
        return f"cuDNN fused attention failed its probe on this GPU ({type(e).__name__}: {str(e)[:300]})"
    return None


def unsupported(dtype, head_dim: int) -> str | None:
    """Why cuDNN cannot serve this dtype / head dimension here, or None."""
    return limits(dtype, head_dim) or missing()


def valid_keys_first(
    k: jax.Array, v: jax.Array, key_valid: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reorder each batch element's keys (and values) so the valid ones come first, in their order.

    Returns (k, v, kv_seqlen [B] int32): the layout cuDNN's padding mask describes.
    """
    order = jnp.argsort(~key_valid, axis=1, stable=True)  # [B, Tk]: valid keys' positions first
    take = lambda x: jnp.take_along_axis(x, order[:, :, None, None], axis=1)
    return take(k), take(v), key_valid.sum(axis=1, dtype=jnp.int32)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_valid: jax.Array | None,
    *,
    scale: float,
    out_dtype=None,
    fused: tuple[Callable, type] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """q [B, Tq, H, D], k/v [B, Tk, H, D] (float16/bfloat16), key_valid [B, Tk] or None ->
    (out [B, Tq, H, D] in ``out_dtype``, default q's; lse [B, Tq, H] fp32).

    ``fused`` = (call, MaskType) replaces jax's private function (tests substitute a stand-in with its
    argument and result contract); default :func:`load`.
    """
    call, mask_type = fused or load()
    b, tq = q.shape[:2]
    if key_valid is None:
        out, lse = call(
            q, k, v, scale=scale, mask_type=mask_type.NO_MASK, qkv_layout="BTNH", return_residual=True
        )
    else:
        k, v, kv_seqlen = valid_keys_first(k, v, key_valid)
        q_seqlen = jnp.full((b,), tq, jnp.int32)
        out, lse = call(
            q,
            k,
            v,
            None,
            None,
            q_seqlen,
            kv_seqlen,
            scale=scale,
            mask_type=mask_type.PADDING,
            qkv_layout="BTNH",
            return_residual=True,
        )
    out = out.astype(out_dtype or q.dtype)
    lse = jnp.transpose(lse, (0, 2, 1)).astype(jnp.float32)  # [B, N, T] -> [B, T, N]
    return clear_empty_rows(out, lse, key_valid)  # kv_seqlen = 0: cuDNN's rows are not defined
