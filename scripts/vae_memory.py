"""Per-device memory and collectives of FLUX's AE decode, row-sharded over 1, 2, 4, 8 devices.

Compiles only, from abstract parameters (nothing is allocated): ``memory_analysis()`` of the compiled
decode program, and its collectives (``jaxdit.hlo_stats``). Runs on emulated CPU devices by default:

    .venv/bin/python scripts/vae_memory.py                      # FLUX AE, 1024x1024, fp32
    .venv/bin/python scripts/vae_memory.py --size 2048 --dtype bfloat16 --devices 1 8

The CPU backend computes bf16 convolutions through f32 copies (of weights too), so on CPU a bf16
program's temp bytes include upcast buffers a GPU does not need; fp32 shows the activation scaling
cleanly.
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=1024, help="image height = width in pixels")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--fast-compile", action="store_true", help="xla_backend_optimization_level=0")
    args = parser.parse_args(argv)

    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        n = max(args.devices)
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
        ).strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from jaxdit import hlo_stats
    from jaxdit.vae.autoencoder_kl import FluxVAE, VAEConfig

    cfg = VAEConfig.preset("flux")
    options = {"xla_backend_optimization_level": 0} if args.fast_compile else None
    vae = FluxVAE.abstract(cfg, jnp.dtype(args.dtype), compiler_options=options)
    f = cfg.downsample_factor
    shape = (args.batch, cfg.latent_channels, args.size // f, args.size // f)
    print(
        f"FLUX AE decode, {args.batch} x {args.size}x{args.size} ({shape[2]}x{shape[3]} latents), {args.dtype}, "
        f"{jax.devices()[0].platform}"
    )
    mib = 2**20
    base = None
    for n in args.devices:
        mesh = None if n == 1 else Mesh(np.array(jax.devices()[:n]), ("tiles",))
        t = time.perf_counter()
        compiled = vae.lower_decode(shape, mesh).compile()
        seconds = time.perf_counter() - t
        mem = hlo_stats.memory_per_device(compiled)
        base = base or mem["temp"]
        stats = hlo_stats.summarize(compiled)
        used = {k: v for k, v in stats.items() if v["count"] and k != "total"}
        comm = ", ".join(f"{k} x{int(v['count'])} ({v['bytes'] / mib:.2f} MiB)" for k, v in used.items())
        print(
            f"{n} device(s): temp {mem['temp'] / mib:8.1f} MiB (x{mem['temp'] / base:.3f} of 1 device), "
            f"params {mem['argument'] / mib:.1f} MiB, output {mem['output'] / mib:.1f} MiB; "
            f"compiled in {seconds:.1f} s; {comm or 'no collectives'}"
        )


if __name__ == "__main__":
    main()
