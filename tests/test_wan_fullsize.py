"""Full size, no weights: one Wan 2.1 T2V-14B step at 720p, 81 frames compiles on 8 emulated devices.

The latent is 16 x 21 x 90 x 160, i.e. 21 x 45 x 80 = 75,600 video tokens after the 1 x 2 x 2 patch, with
512 text tokens. Parameters and inputs are ``jax.ShapeDtypeStruct``s (bf16 weights, as served), so
nothing is allocated; the test prints compile time, the collectives per step and per-device memory.

CPU memory figures: the CPU backend computes bf16 dots in fp32 and keeps fp32 copies of the bf16 weights
in ``temp``, so ``temp`` is about twice the bf16 arguments there; a GPU holds the arguments plus the
activations. The test also reports ``temp - 2 x arguments`` as the activation estimate.
"""

import functools
import math
import time

import jax
import jax.numpy as jnp
import pytest

from jaxdit.hlo_stats import collectives, flops_per_device, memory_per_device
from jaxdit.mesh import ParallelConfig
from jaxdit.models import wan

LATENT = (16, 21, 90, 160)  # channels, frames, height, width (720p, 81 frames)
TEXT_LEN, TEXT_DIM = 512, 4096
GIB = 2**30

CONFIGS = {
    "ulysses8": (ParallelConfig(ulysses=8), 1),
    "cfg2_ulysses4": (ParallelConfig(cfg=2, ulysses=4), 2),  # the two guidance branches over cfg
}


@functools.cache
def _abstract():
    return wan.abstract_model(wan.WanConfig.preset("wan2.1-t2v-14b"), jnp.bfloat16)


@functools.cache
def _compile(parallel: ParallelConfig, batch: int):
    """(compiled step, its ShardedForward, lower + compile seconds), from abstract params and inputs."""
    abstract = _abstract()
    cfg = abstract.config
    tokens = math.prod(wan.latent_grid(LATENT, cfg.patch_size))
    forward = wan.sharded(abstract, parallel.make_mesh(jax.devices()[: parallel.num_devices]))
    spec = jax.ShapeDtypeStruct
    start = time.perf_counter()
    lowered = forward.lower(
        hidden_states=spec((batch, tokens, cfg.patch_features), jnp.bfloat16),
        positions=spec((tokens, 3), jnp.int32),
        timestep=spec((batch,), jnp.float32),
        encoder_hidden_states=spec((batch, TEXT_LEN, TEXT_DIM), jnp.bfloat16),
    )
    compiled = lowered.compile()
    return compiled, forward, time.perf_counter() - start


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_wan14b_720p_81_frames_compiles(name):
    parallel, batch = CONFIGS[name]
    cfg = _abstract().config
    tokens = math.prod(wan.latent_grid(LATENT, cfg.patch_size))
    assert tokens == 75_600
    compiled, forward, seconds = _compile(parallel, batch)

    mem = memory_per_device(compiled)
    # q, k, v and the output of every block, each [B/cfg, N/ulysses, H, D] in bf16 per device. The CPU
    # backend widens bf16 collectives to fp32, so its HLO reports twice these bytes.
    local_batch = batch // parallel.cfg
    ulysses_bytes = 4 * cfg.num_layers * local_batch * (tokens // parallel.ulysses) * cfg.dim * 2
    params = forward.param_bytes_per_device()
    kinds = {}
    for c in collectives(compiled):
        kinds.setdefault(c.kind, [0, 0])
        kinds[c.kind][0] += c.count
        kinds[c.kind][1] += c.count * c.bytes_per_device
    print(
        f"\nWan2.1-T2V-14B 720p x 81 frames ({tokens} tokens, batch {batch}) on {parallel.describe()}: "
        f"lower + compile {seconds:.1f} s; per device: parameters {params / GIB:.2f} GiB, "
        f"arguments {mem['argument'] / GIB:.2f} GiB, temp {mem['temp'] / GIB:.2f} GiB "
        f"(activations ~{(mem['temp'] - 2 * mem['argument']) / GIB:.2f} GiB after the CPU's fp32 weight copies), "
        f"output {mem['output'] / GIB:.3f} GiB; collectives per step: "
        + ", ".join(f"{k} x{n} ({b / GIB:.2f} GiB in the CPU's HLO)" for k, (n, b) in sorted(kinds.items()))
        + f"; the program sends bf16: {ulysses_bytes / GIB:.2f} GiB of all-to-all operands per device"
    )
    # Ulysses only: 4 all-to-alls per block (q, k, v, output) and nothing else; cfg never communicates
    # inside the step (the guidance combination happens outside it).
    assert set(kinds) == {"all-to-all"}
    assert kinds["all-to-all"][0] == 4 * cfg.num_layers
    # The CPU backend carries bf16 collectives as f32 (jaxdit.hlo_stats): twice the bytes there.
    widened = 2 if jax.default_backend() == "cpu" else 1
    assert kinds["all-to-all"][1] == widened * ulysses_bytes
    # Every device holds all 14B bf16 weights (no tensor parallelism here).
    assert params == pytest.approx(mem["argument"], rel=0.01)
    assert 26 * GIB < params < 28 * GIB


@pytest.mark.slow
def test_wan14b_duplicated_work_is_only_the_text_kv():
    # Summed over the 8 devices of ulysses8, the step's matmul FLOPs exceed one device's by the text
    # K/V projections each sequence shard computes for itself: 7 extra copies of 2 x 2 T E^2 per block.
    cfg = _abstract().config
    single, _, seconds = _compile(ParallelConfig(), 1)
    sharded, _, _ = _compile(*CONFIGS["ulysses8"])
    one, eight = flops_per_device(single), 8 * flops_per_device(sharded)
    text_kv = 7 * cfg.num_layers * 2 * (2 * TEXT_LEN * cfg.dim * cfg.dim)
    print(
        f"\nsingle device compile {seconds:.1f} s, {one / 1e15:.3f} PFLOP per step; ulysses8: 8 x per-device "
        f"= {eight / 1e15:.3f} PFLOP (+{(eight - one) / one:.2%}; duplicated text K/V {text_kv / one:.2%})"
    )
    assert eight >= one
    assert eight - one == pytest.approx(text_kv, rel=0.05)  # the rest is the text embedding, also local
    assert (eight - one) / one < 0.005
