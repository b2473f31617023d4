"""The fused kernels in real programs: a full-size FLUX-dev step lowered for a GPU from this CPU host, and
the collectives of parallel attention unchanged by the kernel (kernels change compute, not communication).

Lowering for a GPU from a CPU (``jit(f).trace(...).lower(lowering_platforms=("cuda",))``) runs jax's
Triton lowering of the Pallas kernel and jax's cuDNN lowering rule, so shapes, dtypes and the adapters'
arguments are checked without a GPU. cuDNN needs one thing a CPU host lacks: jax asks the CUDA plugin for
cuDNN's version while tracing ("cuDNN is not detected" here); the cuDNN lowering test answers that probe
with a version (monkeypatched) and lowers jax's real primitive. Without it, asking for cuDNN falls back to
the Triton kernel with one warning.

"No XLA attention" = no ``dot_general`` with batch dimensions in the module: attention's QK^T and PV are
batched over (batch, heads); every other matmul of the model (projections, MLP, modulation) is not.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from test_kernels_cudnn import STAND_IN  # the stand-in with cuDNN's contract (tests/ is on sys.path)

from jaxdit import hlo_stats
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux
from jaxdit.parallel import kernels
from jaxdit.parallel.attention import sharded_attention
from jaxdit.parallel.kernels import cudnn
from jaxdit.parallel.layout import SequenceLayout

BATCH, IMAGE_TOKENS, TEXT_TOKENS = 1, 4096, 512  # FLUX-dev at 1024 x 1024
TRITON_CALL = "__gpu$xla.gpu.triton"
CUDNN_CALL = "__cudnn$fmhaSoftmax"
PARALLEL = [ParallelConfig(ulysses=8), ParallelConfig(ring=2, ulysses=4)]
IDS = ["ulysses8", "ring2xulysses4"]


def _flux_dev_step_text(parallel: ParallelConfig, kernel: dict, platforms=("cuda",)) -> str:
    s = jax.ShapeDtypeStruct
    inputs = {
        "hidden_states": s((BATCH, IMAGE_TOKENS, 64), jnp.bfloat16),
        "encoder_hidden_states": s((BATCH, TEXT_TOKENS, 4096), jnp.bfloat16),
        "pooled_projections": s((BATCH, 768), jnp.bfloat16),
        "timestep": s((BATCH,), jnp.float32),
        "img_ids": s((IMAGE_TOKENS, 3), jnp.float32),
        "txt_ids": s((TEXT_TOKENS, 3), jnp.float32),
        "guidance": s((BATCH,), jnp.float32),
    }
    model = flux.abstract_model(flux.FluxConfig.preset("flux-dev"), jnp.bfloat16)
    forward = flux.sharded(model, parallel.make_mesh(), kernel=kernel)
    return forward.lower(lowering_platforms=platforms, **inputs).as_text()


@pytest.fixture(autouse=True)
def triton_target_gpu(monkeypatch):
    """jax >= 0.11's Triton lowering asks which GPU it compiles for (its compute capability) and finds none
    on this host; answer as an H100 would (jax 0.10 does not ask). Only the GPU the PTX would target."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        return
    if hasattr(gpu_info, "get_gpu_info_from_version"):
        h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
        monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: h100)


def _xla_attention_dots(text: str) -> list[str]:
    ops = (line for line in text.splitlines() if re.search(r"= stablehlo\.dot_general", line))
    return [op for op in ops if "batching_dims" in op]


def _query_shapes(text: str, target: str) -> list[tuple[int, ...]]:
    """The query operand's shape of every custom call to ``target`` (its first operand)."""
    calls = [line for line in text.splitlines() if f"custom_call @{target}(" in line]
    shapes = [re.search(r"\} : \(tensor<((?:\d+x)+)bf16>", line) for line in calls]
    return [tuple(int(n) for n in m.group(1).rstrip("x").split("x")) for m in shapes if m]


def _attention_shape(parallel: ParallelConfig) -> tuple[int, ...]:
    """q [B, T, H, D] of one device's attention after Ulysses' all-to-all: the ring member's share of the
    sequence, 24 / ulysses heads (FLUX-dev's lengths need no padding at these degrees)."""
    return (BATCH, (IMAGE_TOKENS + TEXT_TOKENS) // parallel.ring, 24 // parallel.ulysses, 128)


def test_the_no_xla_attention_check_can_fail():
    # The XLA kernel's step has the batched QK^T / PV dots the fused steps must not have.
    text = _flux_dev_step_text(PARALLEL[0], {"backend": "xla"}, platforms=None)
    assert len(_xla_attention_dots(text)) >= 4 and TRITON_CALL not in text


@pytest.mark.parametrize("parallel", PARALLEL, ids=IDS)
def test_flux_dev_1024px_step_lowers_for_gpu_with_triton(parallel):
    text = _flux_dev_step_text(parallel, {"backend": "triton", "platform": "cuda"})
    shapes = _query_shapes(text, TRITON_CALL)
    assert shapes and set(shapes) == {_attention_shape(parallel)}  # the attention, at its per-device shape
    assert _xla_attention_dots(text) == []


@pytest.fixture
def cudnn_version_probe_answered(monkeypatch):
    """Answer jax's cuDNN version probe as a GPU host with cuDNN 9.8 would (the CUDA plugin is absent)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)


@pytest.mark.parametrize("parallel", PARALLEL, ids=IDS)
def test_flux_dev_1024px_step_lowers_for_gpu_with_cudnn(cudnn_version_probe_answered, parallel):
    with warnings.catch_warnings():
        warnings.simplefilter("error", kernels.KernelFallbackWarning)  # cuDNN itself, no fallback
        text = _flux_dev_step_text(parallel, {"backend": "cudnn", "platform": "cuda"})
    shapes = _query_shapes(text, CUDNN_CALL)
    assert shapes and set(shapes) == {_attention_shape(parallel)} and TRITON_CALL not in text
    # One call per attention layer kind (double, single blocks: the layers are scanned), and on ring2 one
    # more each for the K/V block that arrives from the other ring member.
    assert len(shapes) == 2 * parallel.ring
    assert _xla_attention_dots(text) == []


def test_cudnn_missing_falls_back_to_triton_with_one_warning():
    kernels.select._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = _flux_dev_step_text(PARALLEL[0], {"backend": "cudnn", "platform": "cuda"})
    fallbacks = [w for w in caught if issubclass(w.category, kernels.KernelFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in fallbacks]
    assert "cuDNN is not detected" in str(fallbacks[0].message) and "using 'triton'" in str(
        fallbacks[0].message
    )
    assert TRITON_CALL in text and CUDNN_CALL not in text and _xla_attention_dots(text) == []


# ------------------------------------------------------------------------ communication is the kernel's no


def _collectives(config: dict, kernel: dict, dtype) -> dict:
    cfg = ParallelConfig(**config)
    layout = SequenceLayout((13, 61), cfg.sequence_degree)  # padding in the middle of every shard
    shapes = tuple(jax.ShapeDtypeStruct((1, n, 8, 16), dtype) for n in layout.padded_lengths)
    compiled = (
        jax.jit(sharded_attention(cfg.make_mesh(), layout, **kernel)).lower(shapes, shapes, shapes).compile()
    )
    summary = hlo_stats.summarize(compiled)
    return {kind: (s["count"], s["bytes"]) for kind, s in summary.items() if kind != "total" and s["count"]}


@pytest.fixture
def cudnn_stand_in(monkeypatch):
    monkeypatch.setattr(cudnn, "load", lambda: STAND_IN)


KERNELS = {
    "triton": ({"backend": "triton", "interpret": True}, jnp.float32),
    "splash": ({"backend": "splash", "interpret": True}, jnp.float32),
    "cudnn": ({"backend": "cudnn", "platform": "cuda"}, jnp.bfloat16),
}
#: The strategies plan --verify checks, by the collectives their attention issues.
STRATEGIES = {
    "ring2xulysses4": (dict(ring=2, ulysses=4), {"all-to-all", "collective-permute"}),
    "ulysses8": (dict(ulysses=8), {"all-to-all"}),
    "ring8": (dict(ring=8), {"collective-permute"}),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("backend", list(KERNELS))
def test_kernels_change_no_collective(cudnn_stand_in, backend, strategy):
    # Ulysses' all-to-alls and Ring's permutes of K and V, count and bytes, whatever the kernel: what
    # plan --verify measures with the XLA kernel holds for the fused ones.
    (kernel, dtype), (config, kinds) = KERNELS[backend], STRATEGIES[strategy]
    expected = _collectives(config, {"backend": "xla"}, dtype)
    assert set(expected) == kinds
    assert _collectives(config, kernel, dtype) == expected
