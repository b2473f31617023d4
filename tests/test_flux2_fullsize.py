"""Full-size FLUX.2-dev (32.2 B parameters), no weights: one step at 1024 x 1024 (4096 image + 512 text
tokens) compiles on 8 emulated CPU devices from ``jax.ShapeDtypeStruct`` parameters and inputs in bf16,
with ulysses8 (every weight on every device: 48 heads, 6 per device) and ulysses4 x tensor2. Prints the
per-device memory the compiled program reports.

Memory caveat (as for FLUX.1's test): the CPU backend computes bf16 dots in f32 and keeps f32 copies of
the bf16 weights in ``temp``; the activations are what an fp32 compile reports as temp.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxdit import hlo_stats
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux2
from jaxdit.models.flux2_config import Flux2Config

IMAGE_TOKENS, TEXT_TOKENS = 4096, 512  # 1024 x 1024: 128 x 128 latents of 32 channels, 2 x 2 patches
PARAMETERS = 32_223_281_152
GiB = 2**30


@pytest.mark.parametrize(
    "parallel", [ParallelConfig(ulysses=8), ParallelConfig(ulysses=4, tensor=2)], ids=str
)
def test_flux2_dev_1024px_step_compiles(parallel):
    cfg = Flux2Config.preset("flux2-dev")
    fwd = flux2.sharded(flux2.abstract_model(cfg, jnp.bfloat16), parallel.make_mesh())
    s, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    compiled = fwd.lower(
        hidden_states=s((1, IMAGE_TOKENS, 128), bf16),
        encoder_hidden_states=s((1, TEXT_TOKENS, 15360), bf16),
        timestep=s((1,), f32),
        img_ids=s((IMAGE_TOKENS, 4), f32),
        txt_ids=s((TEXT_TOKENS, 4), f32),
        guidance=s((1,), f32),
    ).compile()
    mem, weights = hlo_stats.memory_per_device(compiled), fwd.param_bytes_per_device()
    print(
        f"\nflux2-dev 1024px bf16 on {parallel.describe()}: per device arguments {mem['argument'] / GiB:.2f} "
        f"GiB (weights {weights / GiB:.2f} GiB), temp {mem['temp'] / GiB:.2f} GiB (CPU f32 weight copies "
        "included)"
    )
    if parallel.tensor == 1:
        assert weights == PARAMETERS * 2
    else:  # tensor halves every block's projection; embedders, modulation and norms stay whole
        assert PARAMETERS < weights < 0.6 * PARAMETERS * 2
    assert mem["argument"] >= weights
