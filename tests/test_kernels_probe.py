"""cuDNN that fails to compile or run on the local GPU (jax issue 32430: CUDA 13) is found once per
process by a tiny probe, and ``auto`` falls back to the Triton kernel with one warning; an fp32 request
for cuDNN is computed in fp32 by XLA, never by the Triton kernel's TF32 matmuls under an fp32 label."""

import warnings

import jax.numpy as jnp
import pytest
from test_kernels_cudnn import STAND_IN  # the stand-in with cuDNN's contract (tests/ is on sys.path)

from jaxdit.parallel import kernels
from jaxdit.parallel.kernels import cudnn

SHAPE = (1, 128, 2, 64)


@pytest.fixture
def failing_probe(monkeypatch):
    compiles = []

    def fail():
        compiles.append(1)
        raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED (stands for jax issue 32430)")

    monkeypatch.setattr(cudnn, "load", lambda: STAND_IN)  # cuDNN detected, jax's entry point present
    monkeypatch.setattr(cudnn, "_local_gpu", lambda: True)
    monkeypatch.setattr(cudnn, "_compile_tiny", fail)
    cudnn.probe_failure.cache_clear()
    kernels.select._warned.clear()
    yield compiles
    cudnn.probe_failure.cache_clear()


def test_a_failing_probe_makes_auto_fall_back_to_triton_with_one_warning(failing_probe):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = [kernels.choose("auto", "cuda", jnp.bfloat16, SHAPE) for _ in range(3)]
    assert chosen == ["triton"] * 3
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, kernels.KernelFallbackWarning)]
    assert len(fallbacks) == 1 and "failed its probe" in fallbacks[0] and "using 'triton'" in fallbacks[0]
    assert failing_probe == [1]  # compiled once per process, not once per trace


def test_a_passing_probe_keeps_cudnn(monkeypatch, failing_probe):
    monkeypatch.setattr(cudnn, "_compile_tiny", lambda: None)
    assert kernels.backend_for("cuda", jnp.bfloat16, SHAPE, requested="auto").backend == "cudnn"


def test_no_local_gpu_compiles_no_probe(monkeypatch):
    monkeypatch.setattr(cudnn, "_compile_tiny", lambda: pytest.fail("probed without a GPU"))
    cudnn.probe_failure.cache_clear()
    assert cudnn.probe_failure() is None  # lowering for a GPU from this CPU host
    cudnn.probe_failure.cache_clear()


def test_fp32_cudnn_request_is_fp32_xla_not_tf32_triton():
    choice = kernels.backend_for("cuda", jnp.float32, SHAPE, requested="cudnn")
    assert choice.backend == "xla" and "TF32" in choice.reason
    # Triton asked for by name in fp32 is the caller's choice, and stays Triton.
    assert kernels.backend_for("cuda", jnp.float32, SHAPE, requested="triton").backend == "triton"


def test_the_real_probe_runs_inside_another_trace(monkeypatch):
    # The probe fires while a model is traced: its ahead-of-time compile and run on host arrays must not
    # join that trace. Here cuDNN is the stand-in, compiled for this CPU; on a GPU host it is cuDNN itself.
    import jax

    monkeypatch.setattr(cudnn, "load", lambda: STAND_IN)
    monkeypatch.setattr(cudnn, "_local_gpu", lambda: True)
    cudnn.probe_failure.cache_clear()
    chosen = []

    @jax.jit
    def traced(x):
        chosen.append(kernels.choose("auto", "cuda", jnp.bfloat16, SHAPE))
        return x + 1

    traced(jnp.zeros(3))
    assert chosen == ["cudnn"] and cudnn.probe_failure() is None
    cudnn.probe_failure.cache_clear()
