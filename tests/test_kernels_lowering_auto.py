"""Every attention layer of a full FLUX-dev and Wan step reaches cuDNN's fused kernel under ``auto`` in
bf16, for each sequence strategy (Ulysses, Ring, USP), lowered for a GPU from this CPU host.

``jit(f).trace(...).lower(lowering_platforms=("cuda",))`` runs jax's cuDNN lowering rule without a GPU;
jax asks the CUDA plugin for cuDNN's version while tracing, which is answered as a cuDNN 9.8 host would.
The count of fused calls says which layers reached the kernel; "no batched dot_general" says that none
was left to XLA (attention's QK^T and PV are the only matmuls batched over batch and heads).
"""

import math
import warnings

import jax
import jax.numpy as jnp
import pytest
from test_kernels_lowering import CUDNN_CALL, TRITON_CALL, _xla_attention_dots, triton_target_gpu  # noqa: F401

from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux, wan
from jaxdit.parallel import kernels

STRATEGIES = {"ulysses8": ParallelConfig(ulysses=8), "ring8": ParallelConfig(ring=8)}
STRATEGIES["usp_ring2xulysses4"] = ParallelConfig(ring=2, ulysses=4)
AUTO = {"backend": "auto", "platform": "cuda"}
s = jax.ShapeDtypeStruct


@pytest.fixture(autouse=True)
def cudnn_host(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)


def _lower(forward, **inputs) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error", kernels.KernelFallbackWarning)  # auto reaches cuDNN itself
        return forward.lower(lowering_platforms=("cuda",), **inputs).as_text()


def _fused_calls(text: str) -> int:
    return sum(f"custom_call @{CUDNN_CALL}(" in line for line in text.splitlines())


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_flux_dev_step_every_attention_reaches_cudnn(name):
    parallel = STRATEGIES[name]
    model = flux.abstract_model(flux.FluxConfig.preset("flux-dev"), jnp.bfloat16)
    text = _lower(
        flux.sharded(model, parallel.make_mesh(), kernel=AUTO),
        hidden_states=s((1, 4096, 64), jnp.bfloat16),
        encoder_hidden_states=s((1, 512, 4096), jnp.bfloat16),
        pooled_projections=s((1, 768), jnp.bfloat16),
        timestep=s((1,), jnp.float32),
        img_ids=s((4096, 3), jnp.float32),
        txt_ids=s((512, 3), jnp.float32),
        guidance=s((1,), jnp.float32),
    )
    # Two scanned layer kinds (double, single blocks), each one call per K/V block a ring member sees.
    assert _fused_calls(text) == 2 * parallel.ring, _fused_calls(text)
    assert _xla_attention_dots(text) == [] and TRITON_CALL not in text


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_wan14b_step_every_attention_reaches_cudnn(name):
    parallel = STRATEGIES[name]
    model = wan.abstract_model(wan.WanConfig.preset("wan2.1-t2v-14b"), jnp.bfloat16)
    cfg = model.config
    tokens = math.prod(wan.latent_grid((16, 21, 60, 104), cfg.patch_size))  # 480p, 81 frames
    text = _lower(
        wan.sharded(model, parallel.make_mesh(), kernel=AUTO),
        hidden_states=s((1, tokens, cfg.patch_features), jnp.bfloat16),
        positions=s((tokens, 3), jnp.int32),
        timestep=s((1,), jnp.float32),
        encoder_hidden_states=s((1, 512, 4096), jnp.bfloat16),
    )
    # One scanned block: self-attention once per K/V block a ring member sees, and cross-attention to the
    # text (whose keys are not split over the sequence) once.
    assert _fused_calls(text) == parallel.ring + 1, _fused_calls(text)
    assert _xla_attention_dots(text) == [] and TRITON_CALL not in text
