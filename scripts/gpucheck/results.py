"""gpu_check's results, rewritten (atomically) after every row."""

from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from pathlib import Path

from gpucheck.report import _targets

# ----------------------------------------------------------------------------------------------------
# Results, written after every row


class Results:
    """Every record so far, and the ``--out`` file rewritten (atomically) after each."""

    def __init__(self, out: str | None, tiny: bool) -> None:
        self.out, self.tiny = (Path(out) if out else None), tiny
        self.records: list[dict] = []
        self.notes: list[str] = []
        self.started = time.monotonic()

    def add(self, record: dict) -> None:
        if record.get("part") == "device" and any(r.get("part") == "device" for r in self.records):
            return  # every worker reports the device; one is enough
        self.records.append(record)
        self.write()

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"gpu_check: {text}", file=sys.stderr, flush=True)
        self.write()

    def part(self, name: str) -> list[dict]:
        return [r for r in self.records if r.get("part") == name]

    def data(self, complete: bool = False) -> dict:
        device = next(iter(self.part("device")), {"device": "unknown", "platform": "unknown", "backends": []})
        meta = {k: v for k, v in device.items() if k != "part"}
        meta.setdefault("jax", None)
        meta.setdefault("jaxlib", None)
        meta.update(
            date=datetime.date.today().isoformat(),
            host=platform.node(),
            python=platform.python_version(),
            tiny=self.tiny,
            notes=list(self.notes),
            elapsed_seconds=round(time.monotonic() - self.started, 1),
        )
        attention, steps = self.part("attention"), self.part("step")
        return {
            "meta": meta,
            "complete": complete,
            "attention": attention,
            "steps": steps,
            "diffusers": self.part("diffusers"),
            "errors": [r for r in attention + steps if "error" in r],
            "targets": _targets(attention, steps, self.tiny),
        }

    def write(self, complete: bool = False) -> None:
        if self.out is None:
            return
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.data(complete), indent=1))
        tmp.replace(self.out)  # atomic: a reader never sees half a file
