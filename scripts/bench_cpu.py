"""The emulated-device measurements behind docs/parallelism.md and docs/BENCHMARKS.md.

On 8 emulated CPU devices, compiles one full-size denoising step per configuration from abstract
shapes (no weights allocated) and compares the compiled program with ``jaxdit plan``'s model
(``jaxdit.plan.verify``): collective bytes sent per device (loop trip counts included), FLOPs per device
and summed over devices against one device, parameter and activation memory per device.

    python scripts/bench_cpu.py                       # FLUX-dev 1024px and Wan2.1-T2V-14B 720p x 81
    python scripts/bench_cpu.py --all                 # every valid configuration of 8 devices
    python scripts/bench_cpu.py --out verify.json     # also the records, with date and versions
    python scripts/bench_cpu.py --small               # the test suite's small models (quick)

A full-size compile takes 10-50 s on two cores (two run at a time) and a few GB of host memory.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from jaxdit.mesh import ParallelConfig  # noqa: E402
from jaxdit.plan.report import format_verify  # noqa: E402
from jaxdit.plan.search import plan  # noqa: E402
from jaxdit.plan.verify import verify_many  # noqa: E402
from jaxdit.plan.workload import Workload  # noqa: E402

P = ParallelConfig
#: The configurations the issue names (cfg2 x ulysses4 only where there are two guidance branches).
NAMED = [P(ulysses=8), P(ring=8), P(ring=2, ulysses=4), P(cfg=2, ulysses=4), P(tensor=2, ulysses=4)]


def workloads(small: bool) -> list[Workload]:
    if not small:
        return [
            Workload.create("flux-dev", height=1024, width=1024),
            Workload.create("wan2.1-t2v-14b", height=720, width=1280, frames=81),
        ]
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_plan import flux_small, wan_small

    return [flux_small("bfloat16"), wan_small("bfloat16")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--all", action="store_true", help="every valid configuration, not only the named ones")
    p.add_argument("--small", action="store_true", help="the test suite's small models")
    p.add_argument("--threads", type=int, default=2, help="concurrent compiles")
    p.add_argument("--out", default=None, help="write the comparisons as JSON here")
    args = p.parse_args(argv)

    jobs = []
    for w in workloads(args.small):
        report = plan(w, 8)
        runnable = [q.config for q in report.plans if q.config.pipefusion == 1]
        configs = runnable if args.all else [c for c in NAMED if c in runnable]
        jobs.append((w, configs))
    start = time.perf_counter()
    results = verify_many(jobs, threads=args.threads, progress=lambda s: print(f"  {s}", file=sys.stderr))
    seconds = time.perf_counter() - start
    versions = {k: importlib.metadata.version(k) for k in ("jax", "jaxlib", "flax")}
    print(
        f"bench_cpu {datetime.date.today().isoformat()}: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"; {seconds:.0f} s"
    )
    for (w, _), comparisons in zip(jobs, results, strict=True):
        print()
        print(format_verify(w.describe(), comparisons))
    if args.out:
        data = {
            "date": datetime.date.today().isoformat(),
            "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
            "versions": versions,
            "seconds": seconds,
            "workloads": [
                {"workload": w.describe(), "comparisons": [c.to_json() for c in comparisons]}
                for (w, _), comparisons in zip(jobs, results, strict=True)
            ],
        }
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    worst = max(abs(c.bytes_ratio - 1) for cs in results for c in cs)
    return 0 if worst <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
