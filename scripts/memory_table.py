"""Per-device memory of full-size models on 8 devices: bf16, --fsdp, --quantize fp8 and both.

From the planner's model (``jaxdit.plan.cost.step_cost``) on abstract shapes: nothing is allocated or
compiled. Its parameter bytes are the sharded model's exactly (``jaxdit plan --verify`` holds them, the
collectives and the FLOPs against compiled programs; tests/test_fsdp.py, tests/test_fp8.py); working
memory (one block's activations, fsdp's two gathered layers and the gathered weights outside the blocks)
is a model. Prints a Markdown table.

    python scripts/memory_table.py
"""

from __future__ import annotations

import dataclasses

from jaxdit.plan.command import parse_config
from jaxdit.plan.cost import step_cost
from jaxdit.plan.search import invalid_reasons
from jaxdit.plan.workload import Workload

GiB = 2**30

#: (label, preset, Workload.create keywords, 8-device mesh)
MODELS = [
    ("FLUX.1-dev 1024x1024", "flux-dev", {}, "ulysses8"),
    ("Wan2.1-T2V-14B 720p x 81", "wan2.1-t2v-14b", dict(height=720, width=1280, frames=81), "cfg2xulysses4"),
    ("Qwen-Image 1328x1328", "qwen-image", {}, "cfg2xulysses4"),
    ("FLUX.2-dev 1024x1024", "flux2-dev", {}, "ulysses8"),
]


def main() -> None:
    print("| model, mesh | bf16 | --fsdp | --quantize fp8 | both |")
    print("|---|---|---|---|---|")
    for label, name, kwargs, mesh in MODELS:
        cells = []
        for fp8, fsdp in ((False, False), (False, True), (True, False), (True, True)):
            w = Workload.create(name, fp8=fp8, **kwargs)
            c = dataclasses.replace(parse_config(mesh), fsdp=fsdp)
            if invalid_reasons(w, c):
                cells.append("n/a")
                continue
            cost = step_cost(w, c)
            work = cost.activation_bytes + cost.kv_cache_bytes
            cells.append(
                f"{cost.memory_bytes / GiB:.2f} ({cost.resident_param_bytes / GiB:.2f} + {work / GiB:.2f})"
            )
        print(f"| {label}, {mesh} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
