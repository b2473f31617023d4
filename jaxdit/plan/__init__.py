"""``jaxdit plan``: a communication, memory and latency model of every parallel configuration, checked
against compiled programs.

- :mod:`jaxdit.plan.workload`: what one denoising step computes (model, tokens, branches, steps).
- :mod:`jaxdit.plan.cost`: the analytic model per strategy (bytes sent, FLOPs, memory per device).
- :mod:`jaxdit.plan.latency`: link and compute rates, overlap, step and generation latency.
- :mod:`jaxdit.plan.search`: every configuration of a device count, valid or not, ranked.
- :mod:`jaxdit.plan.verify`: compile full-size steps from abstract shapes and measure them.
- :mod:`jaxdit.plan.report` / :mod:`jaxdit.plan.command`: tables and the command line.

The formulas are written out in docs/parallelism.md.
"""

from __future__ import annotations

__all__ = ["Hardware", "StepCost", "Workload", "plan", "step_cost", "verify"]

_WHERE = {
    "Hardware": "jaxdit.plan.latency",
    "StepCost": "jaxdit.plan.cost",
    "Workload": "jaxdit.plan.workload",
    "plan": "jaxdit.plan.search",
    "step_cost": "jaxdit.plan.cost",
    "verify": "jaxdit.plan.verify",
}


def __getattr__(name: str):
    # Deferred: the model configs pull in flax; ``jaxdit --help`` need not pay for them.
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'jaxdit.plan' has no attribute {name!r}")
