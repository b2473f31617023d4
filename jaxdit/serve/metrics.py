"""The service's Prometheus metrics, and the count of XLA compilations in this process.

``GET /metrics`` answers in Prometheus' text format (prometheus_client, one registry per server):

- ``jaxdit_queue_depth``: requests waiting for the devices (the running one not counted);
- ``jaxdit_requests_total{kind, outcome}``: every request by how it ended -- completed, failed, cancelled,
  timeout, disconnected, shutdown, rejected_queue_full, rejected_bad_request, rejected_shape;
- ``jaxdit_request_seconds{kind}``: from arrival to the answer, for completed requests;
- ``jaxdit_step_seconds``: one denoising step, wall time on the host (the step waited for);
- ``jaxdit_compilations_total`` and ``jaxdit_compilation_cache_hits_total``: XLA programs built in this
  process, and those loaded from the persistent compilation cache instead (a served shape, once
  compiled, should never move the first).

The compile count listens to jax's monitoring events (``/jax/core/compile/backend_compile_duration``
fires for every executable jax obtains, compiled or loaded from the persistent cache;
``/jax/compilation_cache/cache_hits`` for the loaded ones).
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

__all__ = ["CONTENT_TYPE", "Metrics", "compile_counts"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_counts = {"executables": 0, "cache_hits": 0}
_listening = False


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE:
        with _lock:
            _counts["executables"] += 1


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _counts["cache_hits"] += 1


def listen_for_compiles() -> None:
    """Start counting (once per process; jax has no way to remove a listener)."""
    global _listening
    from jax import monitoring

    with _lock:
        if _listening:
            return
        _listening = True
    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)


def compile_counts() -> tuple[int, int]:
    """(programs compiled, programs loaded from the persistent cache) since :func:`listen_for_compiles`."""
    with _lock:
        return _counts["executables"] - _counts["cache_hits"], _counts["cache_hits"]


class _CompileCollector:
    def collect(self):
        compiled, hits = compile_counts()
        yield CounterMetricFamily("jaxdit_compilations", "XLA programs compiled in this process", compiled)
        yield CounterMetricFamily(
            "jaxdit_compilation_cache_hits", "XLA programs loaded from the persistent compilation cache", hits
        )


#: Step times from milliseconds (tiny models) to minutes (video at full size).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics:
    """The server's metrics in a registry of its own (several servers can share a process in tests)."""

    def __init__(self) -> None:
        listen_for_compiles()
        disable_created_metrics()  # the *_created series (process-wide) would double the page for nothing
        self.registry = CollectorRegistry()
        self.queue_depth = Gauge(
            "jaxdit_queue_depth", "Requests waiting for the devices", registry=self.registry
        )
        self.requests = Counter(
            "jaxdit_requests", "Requests by kind and outcome", ["kind", "outcome"], registry=self.registry
        )
        self.request_seconds = Histogram(
            "jaxdit_request_seconds",
            "Completed requests: arrival to answer",
            ["kind"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.step_seconds = Histogram(
            "jaxdit_step_seconds",
            "One denoising step (host wall time)",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_CompileCollector())

    def outcome(self, kind: str, outcome: str) -> None:
        self.requests.labels(kind=kind, outcome=outcome).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
