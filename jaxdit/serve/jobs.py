"""Requests as jobs: a bounded queue in front of one device worker.

The devices run one generation at a time (a generation already uses the whole mesh), so requests wait
in a FIFO queue of at most ``max_queue``; one more is refused at once (:class:`QueueFull`, answered 429 with
a Retry-After estimated from recent run times) rather than left to wait without bound.

Every job has a deadline (``request_timeout`` from arrival) and may be stopped for a reason: cancelled
(``DELETE``), disconnected (the client went away), timeout, shutdown. A queued job that is stopped leaves
the queue at once; a running one stops after its current step (the step callback tells the pipeline to
stop), so the devices are free again within one step (on a PipeFusion mesh: at the next warm-up step or
the end of the pipelined phase, which is one program).

:meth:`Scheduler.begin_shutdown` refuses new requests, answers every queued one (failed: shutdown) and
lets the running one finish within ``shutdown_grace`` seconds (then stops it at the next step).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from jaxdit.serve.engine import Engine, GenerationCancelled, Output
from jaxdit.serve.metrics import Metrics
from jaxdit.serve.schema import Generation, RequestError

__all__ = ["Job", "QueueFull", "Scheduler", "ShapeNotServed", "ShuttingDown"]

QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
#: Why a job stopped early, and how it is reported: (status, HTTP status, OpenAI error type).
STOPS = {
    "cancelled": (CANCELLED, 409, "cancelled"),
    "disconnected": (CANCELLED, 499, "cancelled"),
    "timeout": (FAILED, 504, "timeout_error"),
    "shutdown": (FAILED, 503, "server_error"),
}

log = logging.getLogger("jaxdit.serve")


class QueueFull(Exception):
    def __init__(self, depth: int, retry_after: int) -> None:
        super().__init__(f"the queue is full ({depth} requests waiting); retry in about {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


class ShapeNotServed(RequestError):
    """A request whose programs were not compiled at start-up, refused (``--new_shapes refuse``)."""


@dataclasses.dataclass(eq=False)
class Job:
    id: str
    generation: Generation
    created: int  # unix seconds
    arrived: float  # time.monotonic()
    deadline: float  # time.monotonic()
    status: str = QUEUED
    steps_done: int = 0
    stop_reason: str | None = None
    error: RequestError | None = None
    output: Output | None = None
    completed_at: int | None = None
    _done: threading.Event = dataclasses.field(default_factory=threading.Event)
    _callbacks: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.generation.kind

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """``fn()`` once the job is finished (at once if it is), from whichever thread finishes it."""
        if not self.done:
            self._callbacks.append(fn)
            if not self.done:
                return
            self._callbacks.remove(fn)
        fn()

    def view(self) -> dict[str, Any]:
        """The job as ``GET /v1/videos/{id}`` shows it (OpenAI's video object plus the step counts)."""
        g = self.generation
        body = {
            "id": self.id,
            "object": "video" if g.kind == "video" else "image",
            "status": self.status,
            "progress": int(100 * self.steps_done / g.steps),
            "steps_done": self.steps_done,
            "steps_total": g.steps,
            "created_at": self.created,
            "completed_at": self.completed_at,
            "size": g.size,
            "prompt": g.prompt,
            "seed": g.seed,
        }
        if g.num_frames is not None:
            body["num_frames"] = g.num_frames
        if self.error is not None:
            body["error"] = {"code": self.error.kind, "message": self.error.message}
        return body


class Scheduler:
    """The queue and the device worker (a thread of its own: jax calls block).

    ``new_shapes``: what a request whose programs were not compiled at start-up gets: ``"compile"`` (once,
    then the shape is served like the others) or ``"refuse"`` (400 naming the field). ``lockstep``: a
    :class:`~jaxdit.serve.lockstep.Leader` when other processes follow this one.
    """

    def __init__(
        self,
        engine: Engine,
        metrics: Metrics | None = None,
        *,
        max_queue: int = 16,
        request_timeout: float = 600.0,
        new_shapes: str = "refuse",
        shutdown_grace: float = 30.0,
        keep_finished: int = 256,
        lockstep: Any = None,
    ) -> None:
        if new_shapes not in ("compile", "refuse"):
            raise ValueError(f"new_shapes must be 'compile' or 'refuse', got {new_shapes!r}")
        if max_queue < 0 or request_timeout <= 0:
            raise ValueError(f"max_queue >= 0 and request_timeout > 0, got {max_queue}, {request_timeout}")
        self.engine, self.metrics = engine, metrics or Metrics()
        self.max_queue, self.request_timeout, self.new_shapes = max_queue, request_timeout, new_shapes
        self.shutdown_grace, self.keep_finished, self.lockstep = shutdown_grace, keep_finished, lockstep
        self._cv = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._jobs: collections.OrderedDict[str, Job] = collections.OrderedDict()
        self._running: Job | None = None
        self._closing = False
        self._shutdown_deadline: float | None = None
        self._mean_seconds = 1.0  # running mean of generation times, for Retry-After
        self._thread = threading.Thread(target=self._work, name="jaxdit-device-worker", daemon=True)

    # ------------------------------------------------------------------ intake
    def lost_processes(self) -> list[int]:
        """Follower processes that stopped answering (their heartbeats), none in a single process."""
        return [] if self.lockstep is None else self.lockstep.lost()

    def check(self, g: Generation) -> None:
        """The mesh's and the shape policy's objections to ``g`` (a :class:`RequestError`), before queueing."""
        lost = self.lost_processes()
        if lost:
            raise RequestError(
                f"process(es) {', '.join(map(str, lost))} of this server stopped answering (no heartbeat); "
                "every generation needs all processes: restart the server",
                None,
                503,
                "server_error",
            )
        self.engine.check(g)
        key = self.engine.shape_key(g)
        if self.new_shapes == "compile" or key in self.engine.compiled:
            return
        served = sorted(self.engine.compiled)
        fields = self.engine.shape_fields  # the request field behind each position of a shape key
        field = next((fields[i] for i in range(len(key)) if all(k[i] != key[i] for k in served)), "size")
        raise ShapeNotServed(
            f"{self.engine.describe(key)} was not compiled at start-up and this server refuses new shapes "
            f"(--new_shapes refuse); it serves: {'; '.join(self.engine.describe(k) for k in served)}",
            field,
        )

    def submit(self, g: Generation) -> Job:
        """Queue a checked generation; raises :class:`QueueFull` or :class:`ShuttingDown`."""
        now = time.monotonic()
        job = Job(
            id=f"{g.kind}_{uuid.uuid4().hex}",
            generation=g,
            created=int(time.time()),
            arrived=now,
            deadline=now + self.request_timeout,
        )
        with self._cv:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                waits = (len(self._queue) + (self._running is not None)) * self._mean_seconds
                raise QueueFull(len(self._queue), max(1, math.ceil(waits)))
            self._queue.append(job)
            self._jobs[job.id] = job
            self.metrics.queue_depth.set(len(self._queue))
            self._cv.notify()
        return job

    def get(self, job_id: str) -> Job | None:
        job = self._jobs.get(job_id)
        if job is not None and job.status == QUEUED and time.monotonic() > job.deadline:
            self.stop(job, "timeout")
        return job

    def stop(self, job: Job, reason: str) -> None:
        """Stop ``job`` for ``reason`` (a key of :data:`STOPS`): at once if queued, else after its step."""
        with self._cv:
            if job.done or job.stop_reason is not None:
                return
            job.stop_reason = reason
            if job in self._queue:
                self._queue.remove(job)
                self.metrics.queue_depth.set(len(self._queue))
                self._finish_stopped(job)

    def forget(self, job_id: str) -> None:
        with self._cv:
            self._jobs.pop(job_id, None)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def closing(self) -> bool:
        return self._closing

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Refuse new requests, answer the queued ones, give the running one ``shutdown_grace`` seconds."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._shutdown_deadline = time.monotonic() + self.shutdown_grace
            while self._queue:
                job = self._queue.popleft()
                job.stop_reason = "shutdown"
                self._finish_stopped(job)
            self.metrics.queue_depth.set(0)
            self._cv.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Shut down and wait for the worker (which then ends any following processes)."""
        self.begin_shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    break
                job = self._queue.popleft()
                self.metrics.queue_depth.set(len(self._queue))
                if time.monotonic() > job.deadline:
                    job.stop_reason = "timeout"
                    self._finish_stopped(job)
                    continue
                job.status, self._running = RUNNING, job
            try:
                self._run(job)
            finally:
                self._running = None
        if self.lockstep is not None:
            self.lockstep.stop()

    def _run(self, job: Job) -> None:
        g, started = job.generation, time.monotonic()
        last = [started]

        def on_step(done: int, total: int) -> bool:
            now = time.monotonic()
            ran = done - job.steps_done  # more than one: a PipeFusion phase, whose steps end together
            if job.steps_done:  # the first report's time includes encoding the prompt
                for _ in range(ran):
                    self.metrics.step_seconds.observe((now - last[0]) / ran)
            last[0], job.steps_done = now, done
            if done == total:
                return True
            if job.stop_reason is None and now > job.deadline:
                job.stop_reason = "timeout"
            if job.stop_reason is None and self._shutdown_deadline and now > self._shutdown_deadline:
                job.stop_reason = "shutdown"
            go = job.stop_reason is None
            if self.lockstep is not None:
                self.lockstep.decide(seq, done, go)
            return go

        seq = None
        try:
            if self.lockstep is not None:
                seq = self.lockstep.publish(g)
            output = self.engine.generate(g, on_step)
        except GenerationCancelled:
            self._finish_stopped(job)
        except Exception as e:  # one request failed; the server goes on
            log.exception("%s failed", job.id)
            error = RequestError(f"the generation failed: {type(e).__name__}: {e}", None, 500, "server_error")
            self._finish(job, FAILED, "failed", error=error)
        else:
            seconds = time.monotonic() - started
            self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * seconds
            self.metrics.request_seconds.labels(kind=g.kind).observe(time.monotonic() - job.arrived)
            self._finish(job, COMPLETED, "completed", output=output)
        finally:
            if seq is not None:
                self.lockstep.finished(seq)

    # ------------------------------------------------------------------ endings
    def _finish_stopped(self, job: Job) -> None:
        reason = job.stop_reason or "cancelled"
        status, http, kind = STOPS[reason]
        g = job.generation
        messages = {
            "cancelled": "cancelled",
            "disconnected": "the client disconnected",
            "timeout": f"timed out after {self.request_timeout:g} s",
            "shutdown": "the server is shutting down",
        }
        where = f" ({job.steps_done} of {g.steps} steps done)" if job.steps_done else " (before it started)"
        self._finish(job, status, reason, error=RequestError(messages[reason] + where, None, http, kind))

    def _finish(
        self, job: Job, status: str, outcome: str, *, error: RequestError | None = None, output=None
    ) -> None:
        job.status, job.error, job.output = status, error, output
        job.completed_at = int(time.time())
        self.metrics.outcome(job.kind, outcome)
        if job.kind != "video":  # images are answered on their connection; nothing to look up later
            self._jobs.pop(job.id, None)
        while len(self._jobs) > self.keep_finished:
            oldest = next((i for i, j in self._jobs.items() if j.done), None)
            if oldest is None:
                break
            self._jobs.pop(oldest)
        job._done.set()
        for fn in job._callbacks:
            fn()
