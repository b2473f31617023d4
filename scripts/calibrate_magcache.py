"""Record jaxdit's shipped MagCache ratios of its bundled model (``jaxdit/cache/ratios/calibrated.json``).

    python scripts/calibrate_magcache.py            # tiny-digits: 100 samples (10 per digit), 20 steps

One generation computes every block and measures the magnitude ratio of the residual of all blocks at
each step (``jaxdit.cache.calibrate``); the ratios are stored under the model's architecture key, where
``MagCache()`` finds them (``FluxTransformer.magcache_defaults``). The defaults written with them are the
threshold, K and retention measured on tiny-digits by ``scripts/cache_sweep.py`` (README "Feature
caching"). ``jaxdit generate --calibrate_magcache FILE`` does the same for any model, into a file.
"""

from __future__ import annotations

import argparse
import os


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--threshold", type=float, default=0.12)
    parser.add_argument("--max_skips", type=int, default=2)
    parser.add_argument("--retention", type=float, default=0.2)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    from jaxdit.cache.calibrate import calibrate, ship
    from jaxdit.cache.magcache import config_key
    from jaxdit.mesh import ParallelConfig
    from jaxdit.pipelines import tiny_digits as tiny

    pipe = tiny.tiny_digits(ParallelConfig().make_mesh(jax.devices()[:1]))
    labels = np.repeat(np.arange(10), args.samples // 10)
    call = dict(negative_prompt="", true_cfg_scale=3.0, height=16, width=16, seed=1, progress=False)
    ratios = calibrate(pipe, "".join(map(str, labels)), num_inference_steps=args.steps, **call)
    key = config_key("flux", tiny.CONFIG)
    source = f"scripts/calibrate_magcache.py: tiny-digits, {args.samples} samples, {args.steps} steps, seed 1, CFG 3"
    ship(key, ratios, source, threshold=args.threshold, max_skips=args.max_skips, retention=args.retention)
    print(f"{key}: {np.round(ratios, 4).tolist()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
