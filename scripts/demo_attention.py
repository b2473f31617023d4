"""USP attention on 8 emulated CPU devices: per strategy, the max error against unsharded attention and
the bytes each device sends, read from the compiled program.

Shapes are FLUX-like in miniature: a text group and an image group whose lengths no degree divides.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxdit import hlo_stats  # noqa: E402
from jaxdit.mesh import ParallelConfig  # noqa: E402
from jaxdit.parallel.attention import parallel_attention, sharded_attention  # noqa: E402
from jaxdit.parallel.layout import SequenceLayout  # noqa: E402
from jaxdit.parallel.local_attention import reference_attention  # noqa: E402

STRATEGIES = [
    ("ulysses8", dict(ulysses=8)),
    ("ring8", dict(ring=8)),
    ("ring2 x ulysses4", dict(ring=2, ulysses=4)),
    ("ring4 x ulysses2", dict(ring=4, ulysses=2)),
    ("cfg2 x ulysses4", dict(cfg=2, ulysses=4)),
    ("data2 x ring2 x ulysses2", dict(data=2, ring=2, ulysses=2)),
    ("tensor2 x ring2 x ulysses2", dict(tensor=2, ring=2, ulysses=2)),
]
BATCH, TEXT, IMAGE, HEADS, HEAD_DIM = 2, 77, 1021, 8, 64


def main() -> int:
    rng = np.random.default_rng(0)
    groups = [
        tuple(
            jnp.asarray(rng.standard_normal((BATCH, n, HEADS, HEAD_DIM)), jnp.float32) for n in (TEXT, IMAGE)
        )
        for _ in range(3)
    ]
    q, k, v = groups
    reference = reference_attention(*(jnp.concatenate(x, axis=1) for x in groups))
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")
    print(f"attention: batch {BATCH}, text {TEXT} + image {IMAGE} tokens, {HEADS} heads x {HEAD_DIM}, fp32\n")
    header = f"{'strategy':<28}{'max |err|':>11}{'all-to-all':>12}{'permutes':>10}{'other':>7}{'sent/device':>14}{'time':>8}"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for name, degrees in STRATEGIES:
        config = ParallelConfig(**degrees)
        mesh = config.make_mesh()
        start = time.perf_counter()
        out = jax.jit(lambda q, k, v, mesh=mesh: parallel_attention(q, k, v, mesh))(q, k, v)
        err = float(jnp.abs(jnp.concatenate(out, axis=1) - reference).max())
        elapsed = time.perf_counter() - start
        worst = max(worst, err)
        # Bytes from the program a model runs: tokens already in the padded shard layout.
        layout = SequenceLayout((TEXT, IMAGE), config.sequence_degree)
        shapes = tuple(
            jax.ShapeDtypeStruct((BATCH, n, HEADS, HEAD_DIM), jnp.float32) for n in layout.padded_lengths
        )
        stats = hlo_stats.summarize(
            jax.jit(sharded_attention(mesh, layout)).lower(shapes, shapes, shapes).compile()
        )
        other = sum(stats[kind]["count"] for kind in ("all-reduce", "all-gather", "reduce-scatter"))
        sent = stats["total"]["bytes_sent"]
        print(
            f"{name:<28}{err:>11.2e}{stats['all-to-all']['count']:>12}{stats['collective-permute']['count']:>10}"
            f"{other:>7}{sent / 1024:>11.1f} KiB{elapsed:>7.1f}s"
        )
    print(f"\nworst error {worst:.2e} (tolerance 1e-5)")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
