"""Per-device memory of HunyuanVideo 1.5's row-parallel VAE decode (or encode), from compiled programs.

No weights are needed: the released VAE's config (``HunyuanVideo15VAEConfig()``: widths 128-1024, 32
latent channels, 16x spatial, 4x temporal) is built abstract and its decode is compiled for 1, 2, 4 and
8 devices (emulated CPU devices unless real ones are present); XLA's ``memory_analysis()`` gives each
device's temporary (activation) bytes, plus arguments (the replicated weights and the latents) and
outputs (its rows of the video). The decode runs the whole clip at once, as diffusers' does without
tiling. ``--encode``: the encode of the whole video instead.

    .venv/bin/python scripts/hunyuan_video15_vae_memory.py --resolution 480p --frames 121
    .venv/bin/python scripts/hunyuan_video15_vae_memory.py --resolution 720p --frames 121
"""

from __future__ import annotations

import argparse
import os
import sys
import time

#: (height, width) in pixels.
RESOLUTIONS = {"480p": (480, 848), "720p": (720, 1280)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", choices=sorted(RESOLUTIONS), default="480p")
    parser.add_argument("--frames", type=int, default=121, help="video frames (4n+1)")
    parser.add_argument("--devices", default="1,2,4,8", help="comma-separated device counts")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--encode", action="store_true", help="the encode instead of the decode")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.devices.split(",")]
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={max(counts)}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp

    from jaxdit.mesh import ParallelConfig
    from jaxdit.vae.hunyuan_video15_vae import HunyuanVideo15VAEConfig, abstract_vae
    from jaxdit.vae.hunyuan_video15_vae_mesh import HunyuanVideo15MeshVAE

    cfg = HunyuanVideo15VAEConfig()
    try:
        frames = cfg.latent_frames(args.frames)
    except ValueError as e:
        parser.error(str(e))
    height, width = RESOLUTIONS[args.resolution]
    s = cfg.spatial_compression_ratio
    dtype = jnp.dtype(args.dtype)
    latent = (1, cfg.latent_channels, frames, height // s, width // s)
    video = (1, cfg.in_channels, args.frames, height, width)
    vae = HunyuanVideo15MeshVAE(abstract_vae(cfg, dtype))
    what = "encode, video {} -> latents {}" if args.encode else "decode, latents {1} -> video {0}"
    print(f"HunyuanVideo 1.5 VAE {what.format(video, latent)}, {dtype.name}, {jax.devices()[0].platform}")
    print(
        f"{'devices':>7} {'rows/tile':>9} {'temp MiB':>9} {'args MiB':>9} {'output MiB':>10} {'compile s':>9}"
    )
    mib = 2.0**20
    for n in counts:
        mesh = ParallelConfig(ring=n).make_mesh(jax.devices()[:n]) if n > 1 else None
        start = time.perf_counter()
        if args.encode:
            stats = vae.compiled_encode(video, mesh, dtype).memory_analysis()
            rows = -(-height // (n * s)) * s  # pixel rows per device, padding included
        else:
            stats = vae.compiled_decode(latent, mesh, dtype).memory_analysis()
            rows = -(-latent[3] // n)  # latent rows per device
        took = time.perf_counter() - start
        print(
            f"{n:>7} {rows:>9} {stats.temp_size_in_bytes / mib:>9.1f} "
            f"{stats.argument_size_in_bytes / mib:>9.1f} {stats.output_size_in_bytes / mib:>10.1f} {took:>9.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
