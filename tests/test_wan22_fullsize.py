"""Full size, no weights: Wan 2.2's denoising steps compile on 8 emulated devices, and their collectives
are the cost model's (``jaxdit.plan``), byte for byte.

- A14B at 720p x 81 frames: 21 x 45 x 80 = 75,600 video tokens, 512 text tokens, CFG (2 branches); I2V
  with 16 noise + 20 condition channels and no CLIP image tokens. Each step runs one expert and both
  experts have one config, so these are every A14B step (the T2V experts have Wan2.1-T2V-14B's config).
- TI2V-5B at 1280 x 704 x 121 frames (the Wan 2.2 VAE: 31 x 44 x 80 latents, 31 x 22 x 40 = 27,280 tokens)
  in image-to-video mode: the per-token timestep mask and the first-frame replacement in the step.

The steps are the pipelines' own (``WanPipeline.prepare`` + ``Denoiser.lower``) on abstract bf16 parameters
(``jax.ShapeDtypeStruct``: nothing allocated), compiled with the planner's quick-compile option (the same
HLO). What is compared with ``jaxdit.plan.cost.step_cost``: the collective kinds, their counts and the bytes
each device sends (CPU dtypes: the CPU backend carries bf16 collectives as fp32), and the parameters per
device. Measured (2026-12, 2-core CPU, quick compiles): 9-12 s each; the byte counts equal the model's
(I2V-A14B ulysses8: 160 all-to-alls, 50.47 GiB sent per device in the CPU's fp32; parameters 26.96 GiB per
device, 53.93 GiB with both experts resident).
"""

import functools
import time

import jax
import numpy as np
import pytest

from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines.request import GenerationRequest
from jaxdit.pipelines.wan import WanPipeline
from jaxdit.plan.cost import step_cost
from jaxdit.plan.verify import FAST_COMPILE, _abstract_model, measure
from jaxdit.plan.workload import Workload

GIB = 2**30


def _request(w: Workload, image: bool) -> GenerationRequest:
    """Zero embeddings of the workload's shape; TI2V with a first frame (image-to-video)."""
    m, (height, width, frames) = w.model, w.size
    temporal, spatial = m.vae_factors
    latent = ((frames - 1) // temporal + 1, height // spatial, width // spatial)
    text = np.zeros((1, w.context[0], m.text_dim), np.float32)
    extra = {}
    if m.condition_channels:
        extra["condition"] = np.zeros((1, m.condition_channels, *latent), np.float32)
    elif image:
        extra["condition"] = np.zeros((1, m.out_channels, 1, *latent[1:]), np.float32)
    return GenerationRequest(
        prompt_embeds=text,
        negative_prompt_embeds=text,
        guidance_scale=5.0,
        height=height,
        width=width,
        num_frames=frames,
        num_inference_steps=w.steps,
        output_type="latent",
        **extra,
    )


@functools.cache
def _compiled(name: str, parallel: ParallelConfig):
    w = Workload.create(name)
    mesh = parallel.make_mesh(jax.devices()[: parallel.num_devices])
    options = dict(expand_timesteps=True) if name == "wan2.2-ti2v-5b" else {}  # VAE factors: from the config
    pipe = WanPipeline(_abstract_model(w.model, w.dtype), mesh, compiler_options=FAST_COMPILE, **options)
    start = time.perf_counter()
    inputs = pipe.prepare(_request(w, image=name == "wan2.2-ti2v-5b")).inputs
    if name == "wan2.2-ti2v-5b":  # image-to-video: the per-token timestep and first-frame paths
        assert "timestep_mask" in inputs.context and "first_frame" in inputs.extras
    lowered = pipe.denoiser.lower(inputs)
    measured, _ = measure(lowered, pipe.forward, parallel, time.perf_counter() - start)
    return w, measured


@pytest.mark.parametrize(
    "name, parallel",
    [
        ("wan2.2-i2v-a14b", ParallelConfig(ulysses=8)),
        ("wan2.2-t2v-a14b", ParallelConfig(cfg=2, ring=2, ulysses=2)),
        ("wan2.2-ti2v-5b", ParallelConfig(cfg=2, ulysses=4)),
    ],
    ids=lambda x: x if isinstance(x, str) else x.describe(),
)
def test_full_size_step_compiles_with_the_modelled_collectives(name, parallel):
    w, m = _compiled(name, parallel)
    model = step_cost(w, parallel)
    modelled = model.by_kind(cpu=True)
    print(
        f"\n{w.describe()} on {parallel.describe()}: compiled in {m.compile_seconds:.0f} s; "
        + ", ".join(
            f"{k} x{int(v['count'])} {v['bytes_sent'] / GIB:.2f} GiB"
            for k, v in m.by_kind.items()
            if v["count"]
        )
        + f" sent per device (model {model.bytes_sent(cpu=True) / GIB:.2f} GiB); parameters "
        f"{m.param_bytes / GIB:.2f} GiB per device (model {model.param_bytes / GIB:.2f} GiB, "
        f"{model.resident_param_bytes / GIB:.2f} GiB with every expert resident); temp {m.temp_bytes / GIB:.2f} GiB"
    )
    assert {k for k, v in m.by_kind.items() if v["count"]} == set(modelled)
    for kind, v in modelled.items():
        assert m.by_kind[kind]["count"] == v["count"], kind
        assert m.by_kind[kind]["bytes_sent"] == pytest.approx(v["bytes_sent"], rel=1e-6), kind
    assert m.param_bytes == model.param_bytes
    assert model.resident_param_bytes == w.experts * model.param_bytes
