"""Per-device memory of a video VAE's row-parallel decode (or encode), from compiled programs (abstract).

No weights are needed: the released VAE's config is built abstract (``--vae wan2.1``: Wan 2.1's,
``wan2.2``: Wan 2.2 TI2V-5B's, ``hunyuanvideo1.5``: HunyuanVideo 1.5's, widths 128-1024, 32 latent
channels, 16x spatial, 4x temporal) and its decode is compiled for 1, 2, 4 and 8 devices (emulated CPU
devices unless real ones are present); XLA's ``memory_analysis()`` gives each device's temporary
(activation) bytes, plus arguments (the replicated weights and the latents) and outputs (its rows of the
video). The decode runs the whole clip at once, as diffusers' does without tiling. ``--encode``: the
encode of the whole video instead (image-to-video encodes it); arguments are then the weights and the
device's band of pixel rows (padded to a multiple of the spatial factor per device).

    .venv/bin/python scripts/video_vae_memory.py --vae wan2.1 --resolution 480p --frames 81
    .venv/bin/python scripts/video_vae_memory.py --vae wan2.1 --resolution 480p --frames 81 --encode
    .venv/bin/python scripts/video_vae_memory.py --vae wan2.2 --resolution 704p --frames 121
    .venv/bin/python scripts/video_vae_memory.py --vae hunyuanvideo1.5 --resolution 720p --frames 121
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any

#: (height, width) in pixels, per VAE: the sizes its pipelines generate.
RESOLUTIONS = {
    "wan2.1": {"480p": (480, 832), "720p": (720, 1280)},
    "wan2.2": {"480p": (480, 832), "720p": (720, 1280), "704p": (704, 1280)},
    "hunyuanvideo1.5": {"480p": (480, 848), "720p": (720, 1280)},
}


@dataclasses.dataclass(frozen=True)
class Subject:
    """One VAE, abstract, with the shapes of one clip and its encode's pixel rows per device."""

    name: str
    vae: Any  # WanVAE or HunyuanVideo15MeshVAE: both compile decode/encode over a mesh
    latent: tuple[int, ...]
    video: tuple[int, ...]
    encode_rows: Callable[[Any], int]  # mesh (or None) -> pixel rows per device, padding included


def wan_subject(which: str, frames: int, height: int, width: int, dtype: Any) -> Subject:
    from jaxdit.vae.wan_vae import WanVAE, WanVAEConfig, abstract_model

    name = "Wan 2.2" if which == "wan2.2" else "Wan 2.1"
    cfg = WanVAEConfig.preset(f"{which}-vae")
    s, t = cfg.spatial_factor, cfg.temporal_factor
    if (frames - 1) % t:
        raise ValueError(f"--frames must be {t}n+1, got {frames}")
    if height % s or width % s:
        raise ValueError(f"{name}'s VAE needs multiples of {s}; got {height}x{width}")
    vae = WanVAE(abstract_model(cfg, dtype))
    latent = (1, cfg.z_dim, (frames - 1) // t + 1, height // s, width // s)
    video = (1, cfg.video_channels, frames, height, width)
    return Subject(name, vae, latent, video, lambda mesh: vae.encode_rows(height, mesh).local)


def hunyuan_subject(frames: int, height: int, width: int, dtype: Any) -> Subject:
    from jaxdit.vae.hunyuan_video15_vae import HunyuanVideo15VAEConfig, abstract_vae
    from jaxdit.vae.hunyuan_video15_vae_mesh import HunyuanVideo15MeshVAE

    cfg = HunyuanVideo15VAEConfig()
    s = cfg.spatial_compression_ratio
    latent = (1, cfg.latent_channels, cfg.latent_frames(frames), height // s, width // s)
    video = (1, cfg.in_channels, frames, height, width)
    vae = HunyuanVideo15MeshVAE(abstract_vae(cfg, dtype))

    def encode_rows(mesh: Any) -> int:
        n = 1 if mesh is None else mesh.size
        return -(-height // (n * s)) * s

    return Subject("HunyuanVideo 1.5", vae, latent, video, encode_rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae", choices=sorted(RESOLUTIONS), default="wan2.1")
    parser.add_argument("--resolution", default="480p", help="480p, 720p (704p: wan2.2)")
    parser.add_argument("--frames", type=int, default=81, help="video frames (4n+1)")
    parser.add_argument("--devices", default="1,2,4,8", help="comma-separated device counts")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--encode", action="store_true", help="the encode instead of the decode")
    args = parser.parse_args(argv)
    sizes = RESOLUTIONS[args.vae]
    if args.resolution not in sizes:
        parser.error(f"--resolution for {args.vae}: one of {', '.join(sizes)}, got {args.resolution!r}")
    counts = [int(c) for c in args.devices.split(",")]
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={max(counts)}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp

    from jaxdit.mesh import ParallelConfig

    dtype = jnp.dtype(args.dtype)
    height, width = sizes[args.resolution]
    try:
        if args.vae == "hunyuanvideo1.5":
            subject = hunyuan_subject(args.frames, height, width, dtype)
        else:
            subject = wan_subject(args.vae, args.frames, height, width, dtype)
    except ValueError as e:
        parser.error(str(e))
    what = "encode, video {} -> latents {}" if args.encode else "decode, latents {1} -> video {0}"
    print(
        f"{subject.name} VAE {what.format(subject.video, subject.latent)}, {dtype.name}, {jax.devices()[0].platform}"
    )
    print(
        f"{'devices':>7} {'rows/tile':>9} {'temp MiB':>9} {'args MiB':>9} {'output MiB':>10} {'compile s':>9}"
    )
    mib = 2.0**20
    for n in counts:
        mesh = ParallelConfig(ring=n).make_mesh(jax.devices()[:n]) if n > 1 else None
        start = time.perf_counter()
        if args.encode:
            stats = subject.vae.compiled_encode(subject.video, mesh, dtype).memory_analysis()
            rows = subject.encode_rows(mesh)
        else:
            stats = subject.vae.compiled_decode(subject.latent, mesh, dtype).memory_analysis()
            rows = -(-subject.latent[3] // n)  # latent rows per device
        took = time.perf_counter() - start
        print(
            f"{n:>7} {rows:>9} {stats.temp_size_in_bytes / mib:>9.1f} "
            f"{stats.argument_size_in_bytes / mib:>9.1f} {stats.output_size_in_bytes / mib:>10.1f} {took:>9.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
