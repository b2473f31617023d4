"""MagCache and TaylorSeer under PipeFusion on the bundled tiny-digits: steps computed / skipped and PSNR.

    python scripts/pipefusion_cache_report.py [--images 20] [--seed 7]

The model's own sampling (20 steps, its CFG scale), ``--images`` digits (every class in turn), on
pipefusion2 with M = 4 patches and 1 warm-up step, each cache at tiny-digits' defaults (what
``jaxdit generate --cache NAME`` makes): the host plan (steps that ran every block, skipped), PSNR of the
pictures against uncached PipeFusion and against the serial (one-device) pipeline, the held-out judge's
accuracy; and, for comparison, the same cache without PipeFusion against the serial pipeline.
"""

from __future__ import annotations

import argparse
import math
import os


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20, help="digits (a multiple of 10)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

    import jax
    import numpy as np

    from jaxdit.generate import GenerateRequest
    from jaxdit.mesh import ParallelConfig
    from jaxdit.pipelines import digits
    from jaxdit.pipelines import tiny_digits as tiny

    def mesh(**degrees):
        config = ParallelConfig(**degrees)
        return config.make_mesh(jax.devices()[: config.num_devices])

    def psnr(a, b):
        mse = float(np.mean((np.clip(a, -1, 1) - np.clip(b, -1, 1)) ** 2))
        return 10 * math.log10(4.0 / mse) if mse else math.inf

    record = tiny.training_record()
    steps, scale = record.get("sample_steps", 20), record.get("cfg_scale", 3.0)
    prompt = "0123456789" * (args.images // 10)
    labels = np.asarray(tiny.parse_prompt(prompt))
    call = dict(negative_prompt="", true_cfg_scale=scale, height=16, width=16, seed=args.seed, progress=False)
    call["num_inference_steps"] = steps
    judge = digits.DigitJudge()
    serial, pf = tiny.tiny_digits(mesh()), tiny.tiny_digits(mesh(pipefusion=2))
    pf_call = dict(call, num_pipeline_patch=4, warmup_steps=1)
    reference = serial(prompt, **call).images
    uncached = pf(prompt, **pf_call).images
    print(
        f"tiny-digits, {args.images} digits, {steps} steps, pipefusion2, M=4, warm-up 1: uncached PipeFusion "
        f"PSNR {psnr(uncached, reference):.1f} dB vs serial, judge {judge.accuracy(uncached, labels):.0%}"
    )
    for name in ("magcache", "taylorseer"):
        cache = GenerateRequest(feature_cache=name).call().cache
        out = pf(prompt, **pf_call, cache=cache)
        plain = serial(prompt, **call, cache=cache)
        ran = out.cache.ran
        print(
            f"{out.cache.setting}: plan {''.join('F' if r else '.' for r in ran)} = {int(ran.sum())} full, "
            f"{int((~ran).sum())} skipped of {steps}; PSNR {psnr(out.images, uncached):.1f} dB vs uncached "
            f"PipeFusion, {psnr(out.images, reference):.1f} dB vs serial, judge "
            f"{judge.accuracy(out.images, labels):.0%}; without PipeFusion: {int(plain.cache.ran.sum())} full, "
            f"{psnr(plain.images, reference):.1f} dB vs serial"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
