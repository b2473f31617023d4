"""tiny-digits in bf16 against the same model with FP8 weights: the held-out judge's score and the PSNR of
each FP8 picture against the bf16 picture of the same seed, for weight-only FP8, FP8 matmuls (emulated on
the CPU) and each with the first and last step in bf16 (``--fp8_skip_steps 1``).

    python scripts/fp8_digits.py [--samples 100] [--steps 20]

100 samples (10 per digit, seed 1, 20 Euler steps, CFG 3.0: the README's quality setting) on one CPU
device, compute in bf16. PSNR is over pixels in [-1, 1] (peak-to-peak 2).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100, help="images, a multiple of 10 (default 100)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.samples < 10 or args.samples % 10:
        parser.error(f"--samples must be a positive multiple of 10, got {args.samples}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import numpy as np

    from jaxdit.mesh import single_device_mesh
    from jaxdit.models.quantize import FP8
    from jaxdit.pipelines.digits import DigitJudge
    from jaxdit.pipelines.tiny_digits import tiny_digits

    labels = np.repeat(np.arange(10), args.samples // 10)
    prompt = "".join(map(str, labels))
    call = dict(negative_prompt="", true_cfg_scale=3.0, height=16, width=16, seed=1, progress=False)
    call["num_inference_steps"] = args.steps
    runs = {
        "bf16": None,
        "fp8 weight-only": FP8("weight"),
        "fp8 matmuls": FP8("matmul"),
        "fp8 weight-only, skip 1": FP8("weight", skip_steps=1),
        "fp8 matmuls, skip 1": FP8("matmul", skip_steps=1),
    }
    judge = DigitJudge()
    base = None
    print(f"tiny-digits, {args.samples} samples, {args.steps} steps, bf16 compute, one CPU device")
    print(f"{'':26} {'judge':>6} {'PSNR vs bf16':>12}")
    for name, fp8 in runs.items():
        pipe = tiny_digits(single_device_mesh(), dtype=jnp.bfloat16, fp8=fp8)
        images = np.asarray(pipe(prompt, **call).images, np.float32)
        base = images if base is None else base
        mse = float(np.mean((images - base) ** 2))
        psnr = "-" if mse == 0 else f"{10 * np.log10(4.0 / mse):.1f} dB"
        print(f"{name:26} {judge.accuracy(images, labels):>6.0%} {psnr:>12}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
