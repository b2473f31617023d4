"""tiny-digits with each feature cache: skip rate, the held-out judge, PSNR against the uncached result,
and the CPU wall time of the denoising loop with and without the cache, side by side in one run.

    python scripts/cache_digits.py                       # cfg2 x ring2 x ulysses2 on 8 emulated CPU devices
    python scripts/cache_digits.py --mesh single --repeats 5
    python scripts/cache_digits.py --fbcache 0.2 --teacache 0.4 --samples 100 --steps 20

100 samples (10 per digit, seed 1, 20 Euler steps, CFG 3.0: the README's quality setting). The loop's
time excludes compilation: every configuration runs once to compile, then ``--repeats`` times in turn
(uncached, First-Block-Cache, TeaCache, uncached, ...) so that a loaded machine slows them alike; the
median is reported beside the steps that ran in full, which do not depend on the load. PSNR is over
pixels in [-1, 1] (peak-to-peak 2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="cfg2xring2xulysses2", help="e.g. single, ulysses4, ring2xulysses2")
    parser.add_argument("--samples", type=int, default=100, help="images, a multiple of 10 (default 100)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fbcache", type=float, default=0.2, help="First-Block-Cache threshold")
    parser.add_argument("--teacache", type=float, default=None, help="TeaCache threshold (default FLUX's)")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per configuration")
    args = parser.parse_args(argv)
    if args.samples < 10 or args.samples % 10:
        parser.error(f"--samples must be a positive multiple of 10, got {args.samples}")

    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    from jaxdit.cache import FirstBlockCache, TeaCache
    from jaxdit.pipelines.digits import DigitJudge
    from jaxdit.pipelines.tiny_digits import tiny_digits
    from jaxdit.plan.command import parse_config

    config = parse_config(args.mesh)
    pipe = tiny_digits(config.make_mesh(jax.devices()[: config.num_devices]))
    labels = np.repeat(np.arange(10), args.samples // 10)
    prompt = "".join(map(str, labels))
    call = dict(negative_prompt="", true_cfg_scale=3.0, height=16, width=16, seed=1, progress=False)
    call["num_inference_steps"] = args.steps
    caches = {
        "uncached": None,
        f"fbcache {args.fbcache:g}": FirstBlockCache(args.fbcache),
        "teacache " + ("FLUX's" if args.teacache is None else f"{args.teacache:g}"): TeaCache(args.teacache),
    }
    results = {name: pipe(prompt, cache=cache, **call) for name, cache in caches.items()}  # compiles
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(args.repeats):
        for name, cache in caches.items():
            times[name].append(pipe(prompt, cache=cache, **call).seconds)

    judge = DigitJudge()
    base = results["uncached"]
    base_time = statistics.median(times["uncached"])
    print(f"tiny-digits, {args.samples} samples, {args.steps} steps, {config.describe()} on CPU")
    header = f"{'':18} {'full steps':>10} {'blocks skipped':>14} {'judge':>6} {'PSNR':>8} {'loop':>8} {'speed-up':>8}"
    print(header)
    for name, out in results.items():
        report = out.cache
        full = report.full_steps if report else args.steps
        skipped = f"{report.skipped_fraction:.0%}" if report else "0%"
        accuracy = judge.accuracy(out.images, labels)
        mse = float(np.mean((out.images - base.images) ** 2))
        psnr = "-" if mse == 0 else f"{10 * np.log10(4.0 / mse):.1f} dB"
        seconds = statistics.median(times[name])
        print(
            f"{name:18} {full:>4} of {args.steps:<3} {skipped:>14} {accuracy:>6.0%} {psnr:>8} "
            f"{seconds:>6.2f} s {base_time / seconds:>7.2f}x"
        )
        if report:
            print(f"{'':18} {report.describe()}")
    print(f"loop: median of {args.repeats} timed runs after one compiling run; the machine may be shared")
    return 0


if __name__ == "__main__":
    sys.exit(main())
