"""PipeFusion's figures: flux-dev and wan-14b parameters per device, bytes sent (compiled vs modelled), quality.

    python scripts/pipefusion_report.py [--devices 8] [--images 100] [--skip-fullsize]

1. flux-dev (bf16) parameters per device at P = 2, 4, 8 from abstract shapes, with the stale K/V a stage
   keeps at 1024x1024 (M = 2P), against xDiT's split of the 57 blocks by count; wan2.1-t2v-14b likewise
   (its full-size programs and tiny-model figures are in tests/test_pipefusion_wan.py).
2. flux-dev at 1024x1024 compiled from abstract shapes (no weights): collective-permute bytes per device of
   the warm-up step and of the pipelined phase (27 steps), measured in the HLO (``jaxdit.hlo_stats``) and
   from ``collective_bytes``.
3. The bundled tiny-digits model (10 digits of each class, its own 20 steps and CFG scale) on
   cfg2 x pipefusion2 x ulysses2 with M = 4: warm-up only (equal to the serial pipeline), and 1, 2 and 3
   warm-up steps: PSNR against the serial pipeline and the held-out judge's accuracy.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
    parser.add_argument("--images", type=int, default=100, help="tiny-digits images (a multiple of 10)")
    parser.add_argument("--skip-fullsize", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdit import hlo_stats
    from jaxdit.mesh import ParallelConfig
    from jaxdit.models import flux
    from jaxdit.parallel.pipefusion import PipeSchedule
    from jaxdit.pipelines import digits
    from jaxdit.pipelines import pipefusion_flux as pf
    from jaxdit.pipelines import tiny_digits as tiny
    from jaxdit.pipelines.tiny_digits import tiny_digits as serial_pipeline

    def mesh(**degrees):
        config = ParallelConfig(**degrees)
        return config.make_mesh(jax.devices()[: config.num_devices])

    gib = lambda b: f"{b / 2**30:.2f} GiB"
    mib = lambda b: f"{b / 2**20:.1f} MiB"

    # 1. Parameters per device.
    config = flux.FluxConfig.preset("flux-dev")
    shapes = flux.parameter_shapes(config)
    count = lambda prefix: sum(math.prod(s) for k, s in shapes.items() if k.startswith(prefix))
    double, single = count("double_blocks.") // 19 * 2, count("single_blocks.") // 38 * 2
    total = sum(math.prod(s) for s in shapes.values()) * 2
    rest = total - 19 * double - 38 * single
    print(
        f"flux-dev bf16: {gib(total)}; double block {mib(double)}, single block {mib(single)}, rest {mib(rest)}"
    )
    print("P  per device   share   1/P    xDiT first stage   stale K/V per device (1024px, M=2P, batch 1)")
    for p in (2, 4, 8):
        model = pf.PipeFusionFlux.abstract(config, mesh(pipefusion=p), jnp.bfloat16)
        per = model.param_bytes_per_device()
        first = math.ceil(57 / p)
        xdit = min(first, 19) * double + max(0, first - 19) * single + rest
        slots = math.ceil(19 / p) + math.ceil(38 / p)
        g = pf.Geometry(512, 64, 64, 2 * p, 1, 1, 1, 1)
        kv = slots * 2 * g.patches * g.piece * config.hidden_size * 2
        print(f"{p}  {gib(per):>10}  {per / total:.3f}  {1 / p:.3f}  {gib(xdit):>16}   {gib(kv)}")

    # 1b. wan2.1-t2v-14b parameters per device (blocks over the stages; embeddings and head replicated).
    from jaxdit.models import wan
    from jaxdit.pipelines import pipefusion_wan as pw

    wconfig = wan.WanConfig.preset("wan2.1-t2v-14b")
    full = pw.PipeFusionWan.abstract(wconfig, mesh(), jnp.bfloat16).param_bytes_per_device()
    print(f"\nwan2.1-t2v-14b bf16: {gib(full)}")
    print("P  per device   share   1/P    stale K/V per device (480p x 81 frames, default M, CFG batch 2)")
    for p in (2, 4, 8):
        model = pw.PipeFusionWan.abstract(wconfig, mesh(pipefusion=p), jnp.bfloat16)
        per = model.param_bytes_per_device()
        grid = (21, 30, 52)
        g = pw.Geometry(grid, pw.default_num_patches(p, grid), 1, 1, 2, 1, 512)
        kv = math.ceil(wconfig.num_layers / p) * 2 * g.batch * g.tokens * wconfig.dim * 2
        print(f"{p}  {gib(per):>10}  {per / full:.3f}  {1 / p:.3f}  {gib(kv)} (M={g.patches})")

    # 2. Full-size programs: bytes measured vs modelled.
    if not args.skip_fullsize:
        print("\nflux-dev 1024x1024, 28 steps, 1 warm-up; collective-permute bytes per device")
        for p in (2, 4, 8):
            parallel = ParallelConfig(pipefusion=p)
            model = pf.PipeFusionFlux.abstract(config, mesh(pipefusion=p), jnp.bfloat16)
            g = pf.Geometry(512, 64, 64, 2 * p, 1, 1, 1, 1)
            start = time.perf_counter()
            warm, run = pf.lower(model, g, steps=28, compiler_options={"xla_backend_optimization_level": 0})
            cost = pf.collective_bytes(
                g, parallel, config.hidden_size, config.out_channels, jnp.bfloat16, False
            )
            ticks = PipeSchedule(p, 2 * p, pf.PASSES, 27).ticks
            measured = []
            for lowered in (warm, run):
                cs = hlo_stats.collectives(lowered.compile())
                measured.append(
                    sum(c.count * c.bytes_sent_per_device for c in cs if c.kind == "collective-permute")
                )
            print(
                f"P={p} M={2 * p}: warm-up step {mib(measured[0])} measured, {mib(cost['warmup_step'])} modelled; "
                f"pipelined phase ({ticks} ticks) {mib(measured[1])} measured, {mib(ticks * cost['tick'])} "
                f"modelled = {mib(cost['step'])} per steady step ({time.perf_counter() - start:.0f} s to compile)"
            )

    # 3. Quality on the tiny model.
    labels = np.repeat(np.arange(10), args.images // 10)
    prompt = "".join(map(str, labels))
    record = tiny.training_record()
    steps = record.get("sample_steps", 20)
    call = dict(
        negative_prompt="",
        true_cfg_scale=record.get("cfg_scale", 3.0),
        height=16,
        width=16,
        num_inference_steps=steps,
        seed=1,
        progress=False,
    )
    judge = digits.DigitJudge()
    serial = serial_pipeline(mesh())(prompt, **call)
    print(
        f"\ntiny-digits, {len(labels)} images, {steps} steps: serial judge accuracy {judge.accuracy(serial.images, labels):.0%}"
    )
    degrees = dict(cfg=2, pipefusion=2, ulysses=2)
    pipe = serial_pipeline(mesh(**degrees))

    def psnr(a, b):
        mse = float(np.mean((np.clip(a, -1, 1) - np.clip(b, -1, 1)) ** 2))
        return 10 * math.log10(4.0 / mse) if mse else math.inf

    for warmup in (steps, 1, 2, 3):
        out = pipe(prompt, **call, num_pipeline_patch=4, warmup_steps=warmup)
        err = float(np.abs(out.latents - serial.latents).max())
        print(
            f"{ParallelConfig(**degrees).describe()}, M=4, warmup {warmup:>2}: max |latent - serial| {err:.1e}, "
            f"PSNR {psnr(out.images, serial.images):.1f} dB, judge accuracy {judge.accuracy(out.images, labels):.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
