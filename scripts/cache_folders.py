"""MagCache, TaylorSeer and DBCache on the tiny random diffusers pipeline folders (FluxPipeline and
WanPipeline, as tests/tiny_pipelines.py writes them from a diffusers config: no download), each at
several settings: steps run in full, block evaluations skipped, PSNR against the uncached output, the
denoising loop's wall time against the uncached loop (side by side in one run), and what ``jaxdit plan``
expects the same skipped steps to save at full size.

    python scripts/cache_folders.py                      # both folders, the README's settings
    python scripts/cache_folders.py --family wan --repeats 5
    python scripts/cache_folders.py --family flux magcache:threshold=0.5,max_skips=2 taylorseer:interval=3

Each setting is ``NAME[:FIELD=VALUE,...]`` (the fields of ``jaxdit.cache``'s configs). The models are
random, so no published MagCache ratios apply: the script first calibrates the folder's ratios with
another prompt and seed (``MagCacheCalibration``, what ``jaxdit generate --calibrate_magcache`` runs) and
every ``magcache`` setting without ``ratios=`` uses them. One CPU device, 20 steps, 4 prompts as one batch
(FLUX: 96 x 96 pixels, CFG off, guidance 3.5; Wan: 9 frames of 96 x 160, CFG 5 with a negative prompt).
PSNR is over pixels in [-1, 1] (peak-to-peak 2), the four outputs together. Timing: every setting runs
once to compile, then ``--repeats`` times in turn with the uncached loop; median loop time as a ratio.

Full size (``jaxdit.plan``): the skipped steps' share is carried over to the full model (FLUX.1-dev,
1024 x 1024, 28 steps; Wan 2.1 T2V 14B, 720 x 1280, 81 frames, 50 steps, CFG), where a skipped step skips
the blocks the cache skips there (MagCache and TaylorSeer: all; DBCache FnBn: all but Fn + Bn); the
column is the fastest 8-device configuration's time without the cache over its time with it.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["a small red cube", "a green tree on a hill", "a cat on a mat", "a city at night"]
CALIBRATION_PROMPT, CALIBRATION_SEED = "a blue sphere on sand", 1

#: The README's settings per folder (the random models' residuals change by 35-160% a step, so their
#: thresholds are well above a trained model's).
SETTINGS = {
    "flux": [
        "magcache:threshold=0.25,max_skips=2,retention=0.2",
        "magcache:threshold=0.5,max_skips=2,retention=0.2",
        "magcache:threshold=1.0,max_skips=3,retention=0.2",
        "taylorseer:interval=2",
        "taylorseer:interval=3",
        "taylorseer:interval=4",
        "dbcache:threshold=0.7,fn=1,bn=0,warmup=2",
        "dbcache:threshold=0.9,fn=1,bn=0,warmup=2",
        "dbcache:threshold=1.2,fn=1,bn=0,warmup=2",
    ],
    "wan": [
        "magcache:threshold=0.12,max_skips=2,retention=0.2",
        "magcache:threshold=0.25,max_skips=2,retention=0.2",
        "magcache:threshold=0.5,max_skips=3,retention=0.2",
        "taylorseer:interval=2",
        "taylorseer:interval=3",
        "taylorseer:interval=4",
        "dbcache:threshold=0.5,fn=1,bn=0,warmup=2",
        "dbcache:threshold=0.7,fn=1,bn=0,warmup=2",
        "dbcache:threshold=1.0,fn=1,bn=0,warmup=2",
    ],
}
#: The full-size model each folder stands for (``jaxdit plan`` presets and sizes).
FULL_SIZE = {
    "flux": dict(model="flux-dev", height=1024, width=1024, frames=None, steps=28, branches=None),
    "wan": dict(model="wan2.1-t2v-14b", height=720, width=1280, frames=81, steps=50, branches=2),
}


def parse_setting(text: str, ratios: str):
    from jaxdit.cache import CACHES

    name, _, fields = text.partition(":")
    options = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        options[key.strip()] = ast.literal_eval(value.strip())
    if name == "magcache":
        options.setdefault("ratios", ratios)
    return CACHES[name](**options)


def skipped_per_skipped_step(cache, depth: int) -> float:
    """The share of a full-size model's blocks one skipped step of ``cache`` skips."""
    name = cache.name
    if name in ("magcache", "taylorseer", "teacache"):
        return 1.0
    if name == "dbcache":
        return (depth - cache.fn - cache.bn) / depth
    if name == "fbcache":
        return (depth - 1) / depth
    raise ValueError(f"no full-size estimate for {name}")


def full_size(family: str):
    """(report, depth) of ``jaxdit plan`` for the folder's full-size model on 8 devices."""
    from jaxdit.plan.latency import Hardware
    from jaxdit.plan.search import plan
    from jaxdit.plan.workload import Workload

    size = FULL_SIZE[family]
    workload = Workload.create(
        size["model"],
        height=size["height"],
        width=size["width"],
        frames=size["frames"],
        steps=size["steps"],
        branches=size["branches"],
    )
    report = plan(workload, 8, Hardware())
    return report, sum(report.workload.stack_depths)


def full_size_speedup(report, skip: float) -> tuple[str, float]:
    """The fastest cached configuration's (name, uncached time / cached time)."""
    from jaxdit.plan.cache import cached_generation

    rows = [(p, cached_generation(p, skip, report.hardware)) for p in report.plans]
    best, seconds = min(((p, s) for p, s in rows if s is not None), key=lambda r: r[1])
    return best.name, best.timing.generation / seconds


def build(family: str):
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_pipelines

    from jaxdit import ParallelConfig

    if family == "flux":
        from jaxdit.pipelines.flux import FluxPipeline

        pipe = FluxPipeline.from_pretrained(tiny_pipelines.flux_folder(), ParallelConfig())
        call = dict(height=96, width=96, guidance_scale=3.5, max_sequence_length=16)
    else:
        from jaxdit.pipelines.wan import WanPipeline

        pipe = WanPipeline.from_pretrained(tiny_pipelines.wan_folder(), ParallelConfig())
        call = dict(height=96, width=160, num_frames=9, guidance_scale=5.0, max_sequence_length=16)
        call["negative_prompt"] = "static"
    return pipe, call


def sweep(family: str, texts: list[str], steps: int, repeats: int) -> None:
    import numpy as np

    from jaxdit.cache.calibrate import ratios_of, save_calibration_file
    from jaxdit.cache.magcache import MagCacheCalibration

    pipe, call = build(family)
    call = dict(call, num_inference_steps=steps, progress=False)
    calibration = pipe(CALIBRATION_PROMPT, seed=CALIBRATION_SEED, cache=MagCacheCalibration(), **call)
    ratios = str(Path(tempfile.mkdtemp(prefix="jaxdit-ratios-")) / f"{family}.json")
    save_calibration_file(ratios, ratios_of(calibration.cache), source=f"scripts/cache_folders.py ({family})")
    print(f"{family}: calibrated ratios {np.round(ratios_of(calibration.cache)[0], 3).tolist()}")
    runs = {"uncached": None, **{t: parse_setting(t, ratios) for t in texts}}
    results = {name: pipe(PROMPTS, seed=0, cache=cache, **call) for name, cache in runs.items()}  # compiles
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, cache in runs.items():
            times[name].append(pipe(PROMPTS, seed=0, cache=cache, **call).seconds)

    report, depth = full_size(family)
    size = FULL_SIZE[family]
    base = results["uncached"]
    base_time = statistics.median(times["uncached"])
    print(f"\ntiny {family} folder, {len(PROMPTS)} prompts, {steps} steps, one CPU device")
    print(f"full size: {size['model']} {size['height']}x{size['width']}, {size['steps']} steps, 8 devices")
    head = f"{'setting':46} {'full steps':>10} {'skipped':>8} {'PSNR':>8} {'loop':>8} {'speed-up':>8}"
    print(f"{head} {'full-size skip':>14} {'plan':>6}")
    for name, out in results.items():
        cache = out.cache
        full = cache.full_steps if cache else steps
        skipped = f"{cache.skipped_fraction:.0%}" if cache else "0%"
        mse = float(np.mean((out.images - base.images) ** 2))
        psnr = "-" if mse == 0 else f"{10 * np.log10(4.0 / mse):.1f} dB"
        seconds = statistics.median(times[name])
        line = f"{name:46} {full:>4} of {steps:<3} {skipped:>8} {psnr:>8} {seconds:>6.2f} s {base_time / seconds:>7.2f}x"
        if cache:
            skip = (1 - full / steps) * skipped_per_skipped_step(runs[name], depth)
            where, speedup = full_size_speedup(report, skip)
            line += f" {skip:>14.0%} {speedup:>5.2f}x ({where})"
        print(line)
    print(f"loop: median of {repeats} timed runs after one compiling run; the machine may be shared")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="*", help="NAME[:FIELD=VALUE,...] (default: the README's)")
    parser.add_argument("--family", choices=("flux", "wan", "both"), default="both")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per setting")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for family in ("flux", "wan") if args.family == "both" else (args.family,):
        sweep(family, args.settings or SETTINGS[family], args.steps, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
