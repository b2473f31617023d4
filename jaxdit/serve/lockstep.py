"""Serving across processes: process 0 takes the HTTP requests; every process runs every generation.

The mesh spans every process's devices, so each generation is one SPMD program that every process must
run, step for step, with the same inputs. Process 0 (the :class:`Leader`) hands each request to the others
(the :func:`follow` loop) through the coordination service's key-value store, which jax already runs for
the process group (hosted by process 0; no other port, no device involved):

- ``jaxdit/serve/<seq>/job``: the request (:class:`~jaxdit.serve.schema.Generation` as JSON), or ``stop``
  to end the followers. One write per request; the followers wait on it with a blocking read, so an idle
  server costs nothing on the devices (a collective would keep a NCCL kernel spinning).
- ``jaxdit/serve/<seq>/step/<k>``: after step k of K (k < K), ``go`` or ``stop``. Cancellation and
  timeouts are decided by process 0 alone, and every process must leave the loop after the same step, or
  the ones that went on would wait forever in the next step's collectives. One small write per step;
  next to a denoising step of a large model (0.1 - 10 s) it is noise.
- ``jaxdit/serve/<seq>/done/<process>``: a follower finished request ``seq``; when all have, process 0
  deletes the request's keys, so the store does not grow with the number of requests served.
- ``jaxdit/serve/alive/<process>``: a follower's heartbeat, a counter it raises every
  :data:`HEARTBEAT_S` from a thread of its own (so a long generation does not silence it). Process 0
  reads the counters: one that has not moved for :data:`LOST_AFTER_S` is a lost process, which
  ``/healthz`` reports (503) and every new request is refused for (503 naming it), instead of a request
  that would block in a collective with a dead peer.

The followers run the same warm-up at start-up (same shapes, same order) before process 0 accepts
requests, so all processes hold the same compiled programs. A follower whose generation raises goes on to
the next request: the same program raises on process 0 too (the inputs are the same everywhere).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from jaxdit.serve.engine import Engine, GenerationCancelled
from jaxdit.serve.schema import Generation

__all__ = ["Heartbeat", "Leader", "follow"]

NAMESPACE = "jaxdit/serve"
STOP = "stop"
#: A follower's blocking reads give up after this long and ask again (jax's reads need a timeout).
POLL_MS = 30_000
#: Seconds between a follower's heartbeats, and the silence after which process 0 counts it lost.
HEARTBEAT_S = 1.0
LOST_AFTER_S = 5.0
#: A follower still warming up beats for the first time only when its programs are compiled: it is not
#: counted lost before this long.
FIRST_BEAT_S = 120.0
ALIVE = f"{NAMESPACE}/alive"

log = logging.getLogger("jaxdit.serve")


def _wait(kv: Any, key: str) -> str:
    """Block until ``key`` exists; a dead process 0 ends this process through jax's heartbeats."""
    while True:
        try:
            return kv.blocking_key_value_get(key, POLL_MS)
        except Exception as e:  # jax raises JaxRuntimeError(DEADLINE_EXCEEDED) when the read times out
            if "DEADLINE_EXCEEDED" not in str(e):
                raise


class Heartbeat:
    """A follower's heartbeat: a daemon thread that raises its counter every ``every`` seconds."""

    def __init__(self, kv: Any, process_id: int, every: float = HEARTBEAT_S) -> None:
        self._stop = threading.Event()
        key = f"{ALIVE}/{process_id}"

        def beat() -> None:
            count = 0
            while not self._stop.is_set():
                try:
                    kv.key_value_set(key, str(count), allow_overwrite=True)
                except Exception:  # the store went away with process 0: nothing left to tell
                    return
                count += 1
                self._stop.wait(every)

        self._thread = threading.Thread(target=beat, name=f"jaxdit-heartbeat-{process_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


class Leader:
    """Process 0's side: publish requests and step decisions; sweep the keys of finished requests; tell
    which followers have stopped beating."""

    def __init__(self, kv: Any, num_processes: int, lost_after: float = LOST_AFTER_S) -> None:
        self.kv, self.num_processes, self.lost_after = kv, num_processes, lost_after
        self.next_seq = 0
        self._unswept: list[int] = []
        # process -> (last counter seen, when it was first seen at that value); a follower not yet heard
        # from has FIRST_BEAT_S (it may still be compiling: the start-up is not its silence)
        now = time.monotonic()
        self._beats: dict[int, tuple[str | None, float]] = {i: (None, now) for i in range(1, num_processes)}

    def lost(self) -> list[int]:
        """The followers whose heartbeat has not moved for ``lost_after`` seconds."""
        try:
            seen = dict(self.kv.key_value_dir_get(f"{ALIVE}/"))
        except Exception:
            seen = {}
        now, lost = time.monotonic(), []
        for i, (value, since) in list(self._beats.items()):
            current = seen.get(f"{ALIVE}/{i}")
            if current != value:
                self._beats[i] = (current, now)
            elif now - since > (self.lost_after if value is not None else max(self.lost_after, FIRST_BEAT_S)):
                lost.append(i)
        return lost

    def publish(self, g: Generation) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.kv.key_value_set(f"{NAMESPACE}/{seq}/job", g.to_json())
        return seq

    def decide(self, seq: int, step: int, go: bool) -> None:
        self.kv.key_value_set(f"{NAMESPACE}/{seq}/step/{step}", "go" if go else STOP)

    def finished(self, seq: int) -> None:
        self._unswept.append(seq)
        for s in list(self._unswept):
            if len(self.kv.key_value_dir_get(f"{NAMESPACE}/{s}/done/")) >= self.num_processes - 1:
                self.kv.key_value_delete(f"{NAMESPACE}/{s}")
                self._unswept.remove(s)

    def stop(self) -> None:
        """End the followers' loops (after the requests already published)."""
        self.kv.key_value_set(f"{NAMESPACE}/{self.next_seq}/job", STOP)


def follow(engine: Engine, kv: Any, process_id: int) -> int:
    """A process other than 0: run every request process 0 publishes until it says stop; returns how many
    requests it ran."""
    heartbeat = Heartbeat(kv, process_id)
    seq = 0
    while True:
        text = _wait(kv, f"{NAMESPACE}/{seq}/job")
        if text == STOP:
            heartbeat.stop()
            return seq
        g = Generation.from_json(text)

        def on_step(done: int, total: int, seq: int = seq) -> bool:
            return done == total or _wait(kv, f"{NAMESPACE}/{seq}/step/{done}") != STOP

        try:
            engine.generate(g, on_step, encode=False)
        except GenerationCancelled:
            pass
        except Exception:
            log.exception(
                "process %d: request %d failed (process 0 reports it to the client)", process_id, seq
            )
        kv.key_value_set(f"{NAMESPACE}/{seq}/done/{process_id}", "1")
        seq += 1
