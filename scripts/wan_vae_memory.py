"""Per-device memory of the Wan VAE's row-parallel decode or encode, from compiled programs (abstract).

No weights are needed: the real VAE (``WanVAEConfig.preset()``; ``--wan22``: Wan 2.2's, TI2V-5B's) is
built abstract and its decode is compiled for 1, 2, 4 and 8 devices (emulated CPU devices unless real ones are present); XLA's
``memory_analysis()`` gives each device's temporary (activation) bytes, plus arguments (the replicated
weights and the latents) and outputs (its rows of the video). ``--encode``: the encode instead (image-to-
video encodes the whole video); arguments are the weights and the device's band of pixel rows (padded to
a multiple of the spatial factor, 8 or 16, per device), outputs its rows of the mean and log-variance.

    .venv/bin/python scripts/wan_vae_memory.py --resolution 480p --frames 81
    .venv/bin/python scripts/wan_vae_memory.py --resolution 480p --frames 81 --encode
    .venv/bin/python scripts/wan_vae_memory.py --wan22 --resolution 704p --frames 121
"""

from __future__ import annotations

import argparse
import os
import sys
import time

RESOLUTIONS = {"480p": (480, 832), "720p": (720, 1280), "704p": (704, 1280)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", choices=sorted(RESOLUTIONS), default="480p")
    parser.add_argument("--frames", type=int, default=81, help="video frames (4n+1)")
    parser.add_argument("--devices", default="1,2,4,8", help="comma-separated device counts")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--encode", action="store_true", help="the encode instead of the decode")
    parser.add_argument("--wan22", action="store_true", help="Wan 2.2's VAE (TI2V-5B) instead of 2.1's")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.devices.split(",")]
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={max(counts)}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp

    from jaxdit.mesh import ParallelConfig
    from jaxdit.vae.wan_vae import WanVAE, WanVAEConfig, abstract_model

    if (args.frames - 1) % 4:
        parser.error(f"--frames must be 4n+1, got {args.frames}")
    name = "Wan 2.2" if args.wan22 else "Wan 2.1"
    cfg = WanVAEConfig.preset("wan2.2-vae" if args.wan22 else "wan2.1-vae")
    height, width = RESOLUTIONS[args.resolution]
    s, t = cfg.spatial_factor, cfg.temporal_factor
    if height % s or width % s:
        parser.error(f"{name}'s VAE needs multiples of {s}; {args.resolution} is {height}x{width}")
    dtype = jnp.dtype(args.dtype)
    latent = (1, cfg.z_dim, (args.frames - 1) // t + 1, height // s, width // s)
    video = (1, cfg.video_channels, args.frames, height, width)
    vae = WanVAE(abstract_model(cfg, dtype))
    if args.encode:
        print(f"{name} VAE encode, video {video} -> mean, logvar {latent}, {dtype.name}")
    else:
        print(f"{name} VAE decode, latents {latent} -> video {video}, {dtype.name}")
    print(
        f"{'devices':>7} {'rows/tile':>9} {'temp MiB':>9} {'args MiB':>9} {'output MiB':>10} {'compile s':>9}"
    )
    mib = 2.0**20
    for n in counts:
        mesh = ParallelConfig(ring=n).make_mesh(jax.devices()[:n]) if n > 1 else None
        start = time.perf_counter()
        if args.encode:
            stats = vae.compiled_encode(video, mesh, dtype).memory_analysis()
            rows = vae.encode_rows(height, mesh).local  # pixel rows per device, padding included
        else:
            stats = vae.compiled_decode(latent, mesh, dtype).memory_analysis()
            rows = -(-latent[3] // n)  # latent rows per device
        took = time.perf_counter() - start
        print(
            f"{n:>7} {rows:>9} {stats.temp_size_in_bytes / mib:>9.1f} "
            f"{stats.argument_size_in_bytes / mib:>9.1f} {stats.output_size_in_bytes / mib:>10.1f} {took:>9.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
