"""Per-device memory of full-size models on 8 devices: bf16, --fsdp, --quantize fp8 and both.

Two sources, one table each:

- the planner's model (``jaxdit.plan.cost.step_cost``) on abstract shapes (default): nothing is allocated
  or compiled. Its parameter bytes are the sharded model's exactly; working memory (one block's
  activations, fsdp's two gathered layers and the gathered weights outside the blocks) is a model;
- ``--compiled``: the pipelines' own denoising step compiled for 8 emulated CPU devices from abstract
  full-size shapes (``jaxdit.plan.verify.lower_step``, no weight allocated; FLUX.2 [dev], which has no
  pipeline, its transformer forward), and the compiled program's own memory analysis per device: the
  bytes of its arguments (parameters, latents, text) and, in brackets, its temporaries as the CPU
  backend reports them. Those include fp32 copies the CPU makes of bf16 weights (whole) and of FP8 ones
  (per layer, inside the scan), which a GPU does not make, so they bound the working memory from above
  and are no GPU figure.

Prints a Markdown table.

    python scripts/memory_table.py [--compiled] [--columns both] [--models flux2-dev]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from jaxdit.plan.command import parse_config
from jaxdit.plan.cost import step_cost
from jaxdit.plan.search import invalid_reasons
from jaxdit.plan.workload import Workload

GiB = 2**30

#: (label, preset, Workload.create keywords, 8-device mesh)
MODELS = [
    ("FLUX.1-dev 1024x1024", "flux-dev", {}, "ulysses8"),
    ("Wan2.1-T2V-14B 720p x 81", "wan2.1-t2v-14b", dict(height=720, width=1280, frames=81), "cfg2xulysses4"),
    ("Qwen-Image 1328x1328", "qwen-image", {}, "cfg2xulysses4"),
    ("FLUX.2-dev 1024x1024", "flux2-dev", {}, "ulysses8"),
]

#: column -> (fp8, fsdp)
COLUMNS = {"bf16": (False, False), "fsdp": (False, True), "fp8": (True, False), "both": (True, True)}
HEADERS = {"bf16": "bf16", "fsdp": "--fsdp", "fp8": "--quantize fp8", "both": "both"}


def modelled(w: Workload, c) -> str:
    cost = step_cost(w, c)
    work = cost.activation_bytes + cost.kv_cache_bytes
    return f"{cost.memory_bytes / GiB:.2f} ({cost.resident_param_bytes / GiB:.2f} + {work / GiB:.2f})"


def lower_flux2_dev(w: Workload, c):
    """FLUX.2 [dev] has no jaxdit pipeline (its guidance embedding), so its transformer forward is what
    compiles: 4096 image + 512 text tokens at 1024 x 1024, as tests/test_flux2_fullsize.py lowers it."""
    import jax
    import jax.numpy as jnp

    from jaxdit.models import flux2
    from jaxdit.models.quantize import quantize_model

    model = flux2.abstract_model(w.model, jnp.bfloat16)
    if w.fp8:
        quantize_model(model, "weight")
    forward = flux2.sharded(model, c.device_mesh(jax.devices()[: c.num_devices]))
    s, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    image, text = 4096, 512
    lowered = forward.lower(
        hidden_states=s((1, image, 128), bf16),
        encoder_hidden_states=s((1, text, w.model.joint_attention_dim), bf16),
        timestep=s((1,), f32),
        img_ids=s((image, 4), f32),
        txt_ids=s((text, 4), f32),
        guidance=s((1,), f32),
    )
    return lowered, forward


#: Models whose denoising step has no pipeline to compile through: what compiles instead.
LOWER = {"flux2-dev": lower_flux2_dev}


def compiled(w: Workload, c) -> str:
    """The compiled step's parameters + working memory per device (see the module docstring)."""
    from jaxdit.plan.verify import lower_step, measure

    start = time.perf_counter()
    lowered, forward = LOWER.get(w.name, lower_step)(w, c)
    m, _ = measure(lowered, forward, c)
    params, work = m.param_bytes, m.activation_bytes  # work: jaxdit plan --verify's estimate
    seconds = time.perf_counter() - start
    print(
        f"  [{w.name} {c.describe()} fp8={w.fp8}: compiled in {seconds:.0f} s; per device arguments "
        f"{m.argument_bytes / GiB:.2f} GiB (parameters {params / GiB:.2f}), temp {m.temp_bytes / GiB:.2f} GiB, "
        f"temp less whole fp32 copies of the narrow weights {work / GiB:.2f}]",
        flush=True,
    )
    return f"{m.argument_bytes / GiB:.2f} [{m.temp_bytes / GiB:.2f}]"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compiled", action="store_true", help="from compiled programs (8 emulated CPU devices)")
    p.add_argument("--columns", nargs="+", choices=tuple(COLUMNS), default=list(COLUMNS))
    p.add_argument("--models", nargs="+", choices=[m[1] for m in MODELS], default=[m[1] for m in MODELS])
    args = p.parse_args(argv)
    if args.compiled:
        from jaxdit.plan.verify import ensure_cpu_devices

        ensure_cpu_devices(8)
    cell = compiled if args.compiled else modelled
    print("| model, mesh | " + " | ".join(HEADERS[k] for k in args.columns) + " |")
    print("|---|" + "---|" * len(args.columns))
    for label, name, kwargs, mesh in MODELS:
        if name not in args.models:
            continue
        cells = []
        for column in args.columns:
            fp8, fsdp = COLUMNS[column]
            w = Workload.create(name, fp8=fp8, **kwargs)
            c = dataclasses.replace(parse_config(mesh), fsdp=fsdp)
            cells.append("n/a" if invalid_reasons(w, c) else cell(w, c))
        print(f"| {label}, {mesh} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
