"""Full-size FLUX.1-dev, no weights: one step at 1024 x 1024 (4096 image + 512 text tokens) compiles on 8
emulated CPU devices from ``jax.ShapeDtypeStruct`` parameters and inputs in bf16, with ulysses8 and with
ring2 x ulysses4. Prints compile time and the per-device memory the compiled program reports.

Memory caveat: the CPU backend computes bf16 dots in f32 and keeps f32 copies of
the bf16 weights in ``temp``, so a bf16 program's temp on CPU is about twice the weights; the activations
are what an fp32 compile reports as temp (printed too). CPU collectives also carry bf16 as f32.
"""

import time

import jax
import jax.numpy as jnp
import pytest

from jaxdit import hlo_stats
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux

BATCH, IMAGE_TOKENS, TEXT_TOKENS = 1, 4096, 512  # 1024 x 1024: 128 x 128 latents, 2 x 2 patches
GiB = 2**30


def _inputs(dtype):
    s = jax.ShapeDtypeStruct
    return {
        "hidden_states": s((BATCH, IMAGE_TOKENS, 64), dtype),
        "encoder_hidden_states": s((BATCH, TEXT_TOKENS, 4096), dtype),
        "pooled_projections": s((BATCH, 768), dtype),
        "timestep": s((BATCH,), jnp.float32),
        "img_ids": s((IMAGE_TOKENS, 3), jnp.float32),
        "txt_ids": s((TEXT_TOKENS, 3), jnp.float32),
        "guidance": s((BATCH,), jnp.float32),
    }


def _compile(parallel: ParallelConfig, dtype):
    cfg = flux.FluxConfig.preset("flux-dev")
    fwd = flux.sharded(flux.abstract_model(cfg, dtype), parallel.make_mesh())
    start = time.perf_counter()
    compiled = fwd.lower(**_inputs(dtype)).compile()
    return compiled, time.perf_counter() - start, fwd


@pytest.mark.parametrize(
    "parallel",
    [ParallelConfig(ulysses=8), ParallelConfig(ring=2, ulysses=4)],
    ids=["ulysses8", "ring2_ulysses4"],
)
def test_flux_dev_1024px_step_compiles(parallel):
    compiled, seconds, fwd = _compile(parallel, jnp.bfloat16)
    mem = hlo_stats.memory_per_device(compiled)
    weights = fwd.param_bytes_per_device()
    print(
        f"\nflux-dev 1024px bf16 on {parallel.describe()}: compile {seconds:.1f} s; per device: "
        f"arguments {mem['argument'] / GiB:.2f} GiB (weights {weights / GiB:.2f} GiB), "
        f"temp {mem['temp'] / GiB:.2f} GiB (CPU f32 weight copies included), output {mem['output'] / 2**20:.1f} MiB"
    )
    assert weights == 11_901_408_320 * 2  # every weight on every device (no tensor parallelism here)
    assert mem["argument"] >= weights

    # The design's collectives and nothing else: 57 attention layers x (4 all-to-alls, 2 permutes per hop).
    layers = 19 + 38
    summary = hlo_stats.summarize(compiled)
    counts = {k: v["count"] for k, v in summary.items() if v["count"] and k != "total"}
    expected = {"all-to-all": 4 * layers}
    if parallel.ring > 1:
        expected["collective-permute"] = 2 * (parallel.ring - 1) * layers
    assert counts == expected
    # Each all-to-all moves one shard's [B, tokens/8, 24 heads, 128]; CPU carries bf16 as f32 (4 bytes).
    tokens_per_device = (IMAGE_TOKENS + TEXT_TOKENS) // parallel.sequence_degree
    assert summary["all-to-all"]["bytes"] == 4 * layers * BATCH * tokens_per_device * 24 * 128 * 4


def test_flux_dev_1024px_activation_memory_fp32():
    # fp32 has no upcast copies, so temp is the activations and attention workspace of one step.
    compiled, seconds, _ = _compile(ParallelConfig(ulysses=8), jnp.float32)
    mem = hlo_stats.memory_per_device(compiled)
    print(
        f"\nflux-dev 1024px fp32 on ulysses8: compile {seconds:.1f} s; per device arguments "
        f"{mem['argument'] / GiB:.2f} GiB, temp (activations) {mem['temp'] / GiB:.2f} GiB"
    )
    assert mem["temp"] < 4 * GiB
