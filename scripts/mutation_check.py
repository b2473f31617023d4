"""Are the tests' bounds sharp? Plant a known mistake in a copy of the library and see a test fail.

    python scripts/mutation_check.py              # every mutation (about 10-20 minutes on 2 cores)
    python scripts/mutation_check.py --list       # names, files and tests
    python scripts/mutation_check.py --only flux-layernorm-eps rope-base
    python scripts/mutation_check.py --only bfl-table-q-k-swapped --tests tests/test_flux_converters.py

Each mutation is one textual change to one file of the library (a LayerNorm epsilon ten times too large,
a wrong RoPE base, AdaLN's shift and scale swapped, a padding mask off by one, ...) and the tests that
should notice it. For each, the checkout (tracked and untracked, non-ignored files) is copied into a
temporary folder, the change is made there, and the tests run there with pytest. A mutation is *caught*
when at least one of its tests fails. The checkout itself is never modified.

The bounds are tests/tolerance.py's (docs/testing.md). A mutation that is not caught means a bound is too
loose for a mistake of that size, or the named tests do not exercise the code: either is a finding. A
mutation whose text is no longer in its file (the code moved) is reported as stale, not as caught.
Exit status: 0 when every mutation is caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    why: str  # the mistake it stands for
    file: str
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "flux-layernorm-eps",
        "FLUX's non-affine LayerNorm with eps 1e-5 instead of 1e-6 (ten times too large)",
        "jaxdit/models/layers.py",
        "def layer_norm(x: jax.Array, eps: float = 1e-6)",
        "def layer_norm(x: jax.Array, eps: float = 1e-5)",
        ("tests/test_flux_vs_diffusers.py::test_single_device",),
    ),
    Mutation(
        "wan-layernorm-eps",
        "Wan's block LayerNorms with eps ten times the config's",
        "jaxdit/models/wan_blocks.py",
        "        eps = self.cfg.eps\n",
        "        eps = self.cfg.eps * 10\n",
        (
            "tests/test_wan_vs_diffusers.py::test_single_device",
            "tests/test_wan_vs_diffusers.py::test_small_residual_stream_single_device",
        ),
    ),
    Mutation(
        "rope-base",
        "RoPE frequencies from base 20000 instead of 10000 (both families share rope_angles)",
        "jaxdit/models/layers.py",
        "omega = 1.0 / (theta ** (",
        "omega = 1.0 / ((2 * theta) ** (",
        ("tests/test_flux_vs_diffusers.py::test_single_device",),
    ),
    Mutation(
        "flux-modulation-order",
        "FLUX's AdaLN modulation with shift and scale swapped",
        "jaxdit/models/flux_blocks.py",
        "return layer_norm(x) * (1.0 + scale[:, None]) + shift[:, None]",
        "return layer_norm(x) * (1.0 + shift[:, None]) + scale[:, None]",
        ("tests/test_flux_vs_diffusers.py::test_single_device",),
    ),
    Mutation(
        "timestep-embedding-order",
        "sinusoidal timestep embedding with sin before cos",
        "jaxdit/models/layers.py",
        "jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)",
        "jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)",
        ("tests/test_wan_vs_diffusers.py::test_single_device",),
    ),
    Mutation(
        "padding-mask-off-by-one",
        "the padding mask admits the first padded key of each token group (sharded runs only)",
        "jaxdit/parallel/layout.py",
        "jnp.arange(n_local) < n_global)",
        "jnp.arange(n_local) <= n_global)",
        ("tests/test_parallel_attention.py::test_strategy_matches_unsharded_fp32",),
    ),
    Mutation(
        "attention-merge-in-bf16",
        "Ring's log-sum-exp merge of partial attention outputs rounding to bf16 (the design: fp32)",
        "jaxdit/parallel/local_attention.py",
        "out = w_a * out_a.astype(jnp.float32) + w_b * out_b.astype(jnp.float32)",
        "out = (w_a * out_a.astype(jnp.float32) + w_b * out_b.astype(jnp.float32)).astype(jnp.bfloat16)",
        ("tests/test_parallel_attention.py::test_strategy_matches_unsharded_fp32",),
    ),
    Mutation(
        "bfl-table-q-k-swapped",
        "the BFL key table reading a single block's linear1 as [k; q; v; mlp] (reader and writer alike)",
        "converters/flux.py",
        'for part, name in enumerate(("attn.q", "attn.k", "attn.v", "mlp_in")):',
        'for part, name in enumerate(("attn.k", "attn.q", "attn.v", "mlp_in")):',
        ("tests/test_layouts_vs_diffusers.py",),
    ),
    Mutation(
        "bfl-table-qk-norms-swapped",
        "the BFL key table taking a single block's query norm from key_norm and the key norm from "
        "query_norm (reader and writer alike)",
        "converters/flux.py",
        'rules.append(KeyRule(f"{s}.attn.q_norm", f"{src}.norm.query_norm.scale", IDENTITY, s))\n'
        '    rules.append(KeyRule(f"{s}.attn.k_norm", f"{src}.norm.key_norm.scale", IDENTITY, s))',
        'rules.append(KeyRule(f"{s}.attn.q_norm", f"{src}.norm.key_norm.scale", IDENTITY, s))\n'
        '    rules.append(KeyRule(f"{s}.attn.k_norm", f"{src}.norm.query_norm.scale", IDENTITY, s))',
        ("tests/test_layouts_vs_diffusers.py",),
    ),
    Mutation(
        "wan-original-table-norms",
        "the original Wan key table taking the cross-attention norm from norm2 (reader and writer alike)",
        "converters/wan.py",
        '"cross_norm": "norm3",',
        '"cross_norm": "norm2",',
        ("tests/test_layouts_vs_diffusers.py",),
    ),
    Mutation(
        "vae-groupnorm-padding",
        "patch-parallel GroupNorm counting padded rows in the variance (tiles with padding only)",
        "jaxdit/vae/spatial.py",
        "var = _psum(jnp.square(masked(dev)).sum(axes), rows) / count",
        "var = _psum(jnp.square(dev).sum(axes), rows) / count",
        ("tests/test_vae_parallel.py::test_sharded_decode_equals_unsharded",),
    ),
    Mutation(
        "pipefusion-bubble-writes",
        "PipeFusion's K/V buffer overwritten on bubble ticks (the tick's validity ignored)",
        "jaxdit/parallel/pipefusion.py",
        "new = jnp.where(valid, fresh[:, :, None].astype(buffer.dtype), old)",
        "new = fresh[:, :, None].astype(buffer.dtype)",
        ("tests/test_pipefusion.py::test_pipelined_phase_equals_a_serial_reference_of_stale_kv",),
    ),
    Mutation(
        "euler-step-dtype",
        "flow-match Euler step rounding dt * v to float16 before the update",
        "jaxdit/samplers/flow_match_euler.py",
        "out = sample.astype(jnp.float32) + dt * model_output.astype(jnp.float32)",
        "out = sample.astype(jnp.float32) + (dt * model_output.astype(jnp.float32)).astype(jnp.float16)",
        ("tests/test_samplers.py",),
    ),
    Mutation(
        "cost-model-final-adaln",
        "the plan's FLOP model forgetting FLUX's final AdaLN (a small replicated matmul)",
        "jaxdit/families/flux.py",
        "            + 2 * b * e * 2 * e  # final adaLN (replicated)\n",
        "",
        ("tests/test_plan.py::test_compiled_step_matches_the_model",),
    ),
    Mutation(
        "demo-cfg-scale",
        "jaxdit generate's default CFG scale for tiny-digits drifting from the trained 3.0 to 2.5",
        "jaxdit/families/tiny_digits.py",
        "num_inference_steps=20, true_cfg_scale=3.0)",
        "num_inference_steps=20, true_cfg_scale=2.5)",
        ("tests/test_main_job.py::test_make_demo",),
    ),
)


def _checkout_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return [f for f in out.stdout.splitlines() if (REPO / f).is_file()]


def _copy_checkout(dst: Path, files: list[str]) -> None:
    for f in files:
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, dst / f)


def run(m: Mutation, files: list[str], timeout: int) -> tuple[str, str]:
    """(outcome, detail) with outcome in caught / NOT CAUGHT / stale / error (``m.tests`` are run)."""
    text = (REPO / m.file).read_text()
    if text.count(m.old) != 1:
        return "stale", f"{m.file}: the text to change occurs {text.count(m.old)} times (expected once)"
    with tempfile.TemporaryDirectory(prefix=f"jaxdit-mutation-{m.name}-") as tmp:
        root = Path(tmp)
        _copy_checkout(root, files)
        (root / m.file).write_text(text.replace(m.old, m.new))
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("JAXDIT_TOLERANCE_LOG", None)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests]
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "error", f"timed out after {timeout} s"
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else proc.stderr.strip()[-200:]
    if proc.returncode == 1:  # tests ran and some failed
        first = next((ln for ln in lines if ln.startswith(("E ", "FAILED"))), summary)
        return "caught", first.strip()[:160]
    if proc.returncode == 0:
        return "NOT CAUGHT", summary
    return "error", f"pytest exit {proc.returncode}: {summary}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per mutation")
    parser.add_argument(
        "--tests", nargs="+", metavar="NODE", help="run these tests instead of each mutation's own"
    )
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = sorted(set(args.only or ()) - set(known))
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(unknown)}; known: {', '.join(known)}")
    chosen = [known[n] for n in args.only] if args.only else list(MUTATIONS)
    if args.tests:
        chosen = [dataclasses.replace(m, tests=tuple(args.tests)) for m in chosen]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.why}\n    {m.file}\n    tests: {' '.join(m.tests)}")
        return 0
    files = _checkout_files()
    results = []
    for m in chosen:
        start = time.perf_counter()
        outcome, detail = run(m, files, args.timeout)
        results.append(outcome)
        print(f"{m.name:26s} {outcome:10s} {time.perf_counter() - start:6.0f} s  {detail}", flush=True)
    caught = results.count("caught")
    print(f"\n{caught} of {len(results)} mutations caught")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
