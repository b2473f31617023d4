"""A short load test of a running ``jaxdit serve``: requests per second and latency percentiles.

    jaxdit serve --emulate_devices 8 --use_cfg_parallel --ring_degree 2 --ulysses_degree 2 --port 8000 &
    python scripts/load_test.py --url http://127.0.0.1:8000 --requests 200 --concurrency 8

Each client sends ``POST /v1/images/generations`` requests back to back (the prompt cycles through the
digits, the seed through ``--seeds``), checks that each answer is a PNG, and records its latency. The
report gives the throughput over the whole run, latency percentiles of the successful requests, the HTTP
statuses, and the server's compile count before and after (from ``/metrics``): it should not move.
Standard library only, so it runs against a server anywhere.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import dataclasses
import json
import re
import sys
import time
import urllib.error
import urllib.request

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclasses.dataclass
class Result:
    index: int
    status: int
    seconds: float
    images: list[bytes]
    error: str | None = None


def request_body(index: int, seeds: int, steps: int | None, size: str | None) -> dict:
    body = {"prompt": str(index % 10), "seed": index % seeds}
    if steps is not None:
        body["steps"] = steps
    if size is not None:
        body["size"] = size
    return body


def post_image(url: str, body: dict, index: int = 0, timeout: float = 600.0) -> Result:
    """One ``POST /v1/images/generations``; the decoded PNGs, or the error."""
    request = urllib.request.Request(
        f"{url}/v1/images/generations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
            status = response.status
    except urllib.error.HTTPError as e:
        message = json.loads(e.read() or b"{}").get("error", {}).get("message", "")
        return Result(index, e.code, time.perf_counter() - start, [], message)
    seconds = time.perf_counter() - start
    images = [base64.b64decode(item["b64_json"]) for item in answer["data"]]
    bad = [i for i, png in enumerate(images) if not png.startswith(PNG_SIGNATURE)]
    return Result(index, status, seconds, images, f"answer {bad} is not a PNG" if bad else None)


def compilations(url: str) -> int | None:
    """``jaxdit_compilations_total`` from the server's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    match = re.search(r"^jaxdit_compilations_total (\S+)$", text, re.MULTILINE)
    return int(float(match[1])) if match else None


def run(
    url: str, requests: int, concurrency: int, bodies=None, timeout: float = 600.0
) -> tuple[list[Result], float]:
    """``requests`` requests from ``concurrency`` clients; (results in request order, wall seconds)."""
    bodies = bodies or (lambda i: request_body(i, 4, None, None))
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(post_image, url, bodies(i), i, timeout) for i in range(requests)]
        results = [f.result() for f in futures]
    return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the nearest ranks."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def report(results: list[Result], seconds: float) -> dict:
    ok = [r.seconds for r in results if r.status == 200 and r.error is None]
    statuses: dict[int, int] = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    summary = {"requests": len(results), "seconds": seconds, "requests_per_second": len(results) / seconds}
    summary["statuses"] = statuses
    if ok:
        summary.update({f"p{q}": percentile(ok, q) for q in (50, 90, 99)}, mean=sum(ok) / len(ok))
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seeds", type=int, default=4, help="seeds cycle through 0..N-1")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--size", default=None, help="WIDTHxHEIGHT (default: the model's)")
    p.add_argument("--warmup", type=int, default=8, help="requests sent (and not counted) first")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    bodies = lambda i: request_body(i, args.seeds, args.steps, args.size)
    if args.warmup:
        run(args.url, args.warmup, min(args.warmup, args.concurrency), bodies)
    before = compilations(args.url)
    results, seconds = run(args.url, args.requests, args.concurrency, bodies)
    summary = report(results, seconds)
    summary["compilations_during_run"] = None if before is None else compilations(args.url) - before
    errors = sorted({r.error for r in results if r.error})
    if args.json:
        print(json.dumps(dict(summary, errors=errors), indent=2))
    else:
        print(
            f"{summary['requests']} requests from {args.concurrency} clients in {seconds:.2f} s: "
            f"{summary['requests_per_second']:.1f} requests/s; statuses {summary['statuses']}"
        )
        if "p50" in summary:
            print(
                f"latency p50 {1000 * summary['p50']:.1f} ms, p90 {1000 * summary['p90']:.1f} ms, "
                f"p99 {1000 * summary['p99']:.1f} ms, mean {1000 * summary['mean']:.1f} ms"
            )
        print(f"compilations during the run: {summary['compilations_during_run']}")
        for e in errors:
            print(f"error: {e}")
    return 0 if summary["statuses"].get(200, 0) == len(results) and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
