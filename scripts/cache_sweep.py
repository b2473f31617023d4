"""tiny-digits with MagCache, TaylorSeer and DBCache (and First-Block-Cache / TeaCache) at several
settings: steps run in full, block evaluations skipped, the held-out judge, PSNR against the uncached
pictures, and the denoising loop's wall time against the uncached loop, side by side in one run.

    python scripts/cache_sweep.py                                   # the README's table (one CPU device)
    python scripts/cache_sweep.py --mesh cfg2xring2xulysses2 --repeats 3
    python scripts/cache_sweep.py magcache:threshold=0.25 dbcache:threshold=0.3,fn=1,bn=0,warmup=2

Each setting is ``NAME[:FIELD=VALUE,...]`` (the fields of ``jaxdit.cache``'s configs); ``default`` stands
for the family's default of a cache (what ``jaxdit generate --cache NAME`` runs). 100 samples (10 per
digit, seed 1, 20 Euler steps, CFG 3.0). Timing: every setting runs once to compile, then ``--repeats``
times in turn with the uncached loop, so that a loaded machine slows them alike; the median loop time
is reported as a ratio to the uncached median. PSNR is over pixels in [-1, 1] (peak-to-peak 2). The
last columns: the skipped steps' share carried over to FLUX.1-dev (1024 x 1024, 28 steps, 57 blocks) and
the speed-up ``jaxdit plan`` expects from it on 8 devices (scripts/cache_folders.py says how).
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys

import cache_folders  # scripts/: the full-size estimate

#: The README's sweep: each new cache at 3-4 settings, its default among them.
DEFAULT_SETTINGS = [
    "default:magcache",
    "magcache:threshold=0.06",
    "magcache:threshold=0.12",
    "magcache:threshold=0.5,max_skips=3",
    "default:taylorseer",
    "taylorseer:interval=2",
    "taylorseer:interval=4",
    "taylorseer:interval=5",
    "default:dbcache",
    "dbcache:threshold=0.1,fn=1,bn=0,warmup=2",
    "dbcache:threshold=0.2,fn=1,bn=0,warmup=2",
    "dbcache:threshold=0.25,fn=1,bn=1,warmup=2",
    "fbcache:threshold=0.2,taylor_order=1",
    "magcache:threshold=0.25,taylor_order=1",
]


def parse_setting(text: str, family) -> tuple[str, object]:
    from jaxdit.cache import CACHES

    if text.startswith("default:"):
        name = text.split(":", 1)[1]
        options = dict(family.cache_options.get(name, {}))
        if name in family.cache_thresholds:
            options["threshold"] = family.cache_thresholds[name]
        return f"{name} (default)", CACHES[name](**options)
    name, _, fields = text.partition(":")
    options = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        options[key.strip()] = ast.literal_eval(value.strip())
    return text, CACHES[name](**options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="*", default=DEFAULT_SETTINGS)
    parser.add_argument("--mesh", default="single", help="e.g. single, cfg2xring2xulysses2")
    parser.add_argument("--samples", type=int, default=100, help="images, a multiple of 10 (default 100)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per setting")
    args = parser.parse_args(argv)
    if args.samples < 10 or args.samples % 10:
        parser.error(f"--samples must be a positive multiple of 10, got {args.samples}")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    from jaxdit import families
    from jaxdit.pipelines.digits import DigitJudge
    from jaxdit.pipelines.tiny_digits import tiny_digits
    from jaxdit.plan.command import parse_config

    family = families.bundled("tiny-digits")
    settings = dict(parse_setting(s, family) for s in args.settings)
    config = parse_config(args.mesh)
    pipe = tiny_digits(config.make_mesh(jax.devices()[: config.num_devices]))
    labels = np.repeat(np.arange(10), args.samples // 10)
    prompt = "".join(map(str, labels))
    call = dict(negative_prompt="", true_cfg_scale=3.0, height=16, width=16, seed=1, progress=False)
    call["num_inference_steps"] = args.steps
    runs = {"uncached": None, **settings}
    results = {name: pipe(prompt, cache=cache, **call) for name, cache in runs.items()}  # compiles
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, cache in runs.items():
            times[name].append(pipe(prompt, cache=cache, **call).seconds)

    judge = DigitJudge()
    base = results["uncached"]
    base_time = statistics.median(times["uncached"])
    print(f"tiny-digits, {args.samples} samples, {args.steps} steps, {config.describe()} on CPU")
    # What jaxdit plan expects the same skipped steps to save on FLUX.1-dev (tiny-digits' architecture).
    full_size, depth = cache_folders.full_size("flux")
    print(
        f"{'setting':44} {'full steps':>10} {'skipped':>8} {'judge':>6} {'PSNR':>8} {'loop':>8} {'speed-up':>8}"
        f" {'full-size skip':>14} {'plan':>6}"
    )
    for name, out in results.items():
        report = out.cache
        full = report.full_steps if report else args.steps
        skipped = f"{report.skipped_fraction:.0%}" if report else "0%"
        accuracy = judge.accuracy(out.images, labels)
        mse = float(np.mean((out.images - base.images) ** 2))
        psnr = "-" if mse == 0 else f"{10 * np.log10(4.0 / mse):.1f} dB"
        seconds = statistics.median(times[name])
        print(
            f"{name:44} {full:>4} of {args.steps:<3} {skipped:>8} {accuracy:>6.0%} {psnr:>8} "
            f"{seconds:>6.2f} s {base_time / seconds:>7.2f}x"
            + (_full_size(full_size, depth, settings[name], full / args.steps) if report else "")
        )
        if report:
            print(f"{'':44} {report.describe()}")
    print(f"loop: median of {args.repeats} timed runs after one compiling run; the machine may be shared")
    print(f"full size: {cache_folders.FULL_SIZE['flux']}, 8 devices (scripts/cache_folders.py)")
    return 0


def _full_size(report, depth: int, cache, full_share: float) -> str:
    """The skipped steps' share carried over to FLUX.1-dev, and jaxdit plan's speed-up for it."""
    skip = (1 - full_share) * cache_folders.skipped_per_skipped_step(cache, depth)
    where, speedup = cache_folders.full_size_speedup(report, skip)
    return f" {skip:>14.0%} {speedup:>5.2f}x ({where})"


if __name__ == "__main__":
    sys.exit(main())
