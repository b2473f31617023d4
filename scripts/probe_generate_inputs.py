"""Try `jaxdit generate` with bad inputs and faults, and count how each run ended.

    python scripts/probe_generate_inputs.py [--tree PATH]

Every case runs ``python -m jaxdit.cli generate ...`` in a fresh folder (8 emulated CPU devices), with the
source tree at ``--tree`` (default: this checkout) first on the path, so the same cases can be run against
an older checkout. Each run is classed as:

- clear: exit code 2, one line on stderr naming the problem, nothing written;
- traceback: a Python traceback on stderr;
- silent: exit code 0 and an output written although the input was bad (a wrong picture);
- ok: exit code 0 for an input that is valid, saying what it did (``VALID``);
- hang: still running after the time limit;
- unhelpful: any other failure;
- leftovers (counted apart): files or folders the run left behind in its folder.

The tiny FLUX and Wan pipeline folders are built with diffusers (tests/tiny_pipelines.py), as the test
suite builds them; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 120


def _folders(work: Path) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_pipelines
    from reliability_support import overflowing_copy

    flux = tiny_pipelines.flux_folder()
    wan_i2v, _ = tiny_pipelines.wan_i2v()

    def overflowing(component: str, key: str) -> Path:
        return overflowing_copy(flux, work / f"flux-{component}-overflow", component, key)

    bad_frame = work / "frame.png"
    bad_frame.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    config = json.loads((flux / "transformer" / "config.json").read_text())
    text, pooled = config["joint_attention_dim"], config["pooled_projection_dim"]
    nan_embeds = work / "nan.npz"
    np.savez(
        nan_embeds,
        prompt_embeds=np.full((1, 8, text), np.nan, np.float32),
        pooled_prompt_embeds=np.zeros((1, pooled), np.float32),
    )
    int_embeds = work / "int.npz"
    np.savez(
        int_embeds,
        prompt_embeds=np.ones((1, 8, text), np.int32),
        pooled_prompt_embeds=np.zeros((1, pooled), np.float32),
    )
    return {
        "flux": flux,
        "flux_transformer": flux / "transformer",
        "wan_i2v": wan_i2v,
        "overflow_transformer": overflowing("transformer", "proj_out.weight"),
        "overflow_vae": overflowing("vae", "conv_out.weight"),
        "bad_frame": bad_frame,
        "nan_embeds": nan_embeds,
        "int_embeds": int_embeds,
    }


#: Inputs a run should accept, and what it must say it did (the others should end in a clear error).
VALID = {
    "tiny: 20 x 20 (not the trained size)": "not run at this size",
    "tiny: empty prompt": "one unconditional sample",
    "tiny: a prompt of separators only": "one unconditional sample",
}


def cases(f: dict[str, Path]) -> list[tuple[str, list[str]]]:
    flux = ["--weights", str(f["flux"]), "--prompt", "a cube", "--steps", "2", "--max_sequence_length", "8"]
    small = ["--height", "16", "--width", "16"]
    return [
        ("tiny: empty prompt", ["--prompt", ""]),
        ("tiny: 65 digits", ["--prompt", "7" * 65, "--steps", "1"]),
        ("tiny: 4000 x 4000", ["--height", "4000", "--width", "4000", "--steps", "1"]),
        ("tiny: 20 x 20 (not the trained size)", ["--height", "20", "--width", "20", "--steps", "2"]),
        ("output under /proc", ["--steps", "2", "--output", "/proc/no/such.png"]),
        ("output is a folder", ["--steps", "2", "--output", "."]),
        ("output under a file", ["--steps", "2", "--output", "a-file/x.png"]),
        ("tiny: undecodable prompt bytes", ["--prompt", os.fsdecode(b"12\xff")]),
        (
            "FLUX: transformer weights that overflow",
            [*flux, *small, "--weights", str(f["overflow_transformer"])],
        ),
        ("FLUX: VAE weights that overflow", [*flux, *small, "--weights", str(f["overflow_vae"])]),
        ("FLUX: 100000 x 100000", [*flux, "--height", "100000", "--width", "100000"]),
        ("FLUX: undecodable prompt bytes", [*flux, *small, "--prompt", os.fsdecode(b"ab\xff")]),
        (
            "Wan I2V: unreadable first frame",
            ["--weights", str(f["wan_i2v"]), "--prompt", "a", "--image", str(f["bad_frame"]), "--steps", "1"],
        ),
        (
            "FLUX checkpoint: NaN embeddings",
            ["--weights", str(f["flux_transformer"]), "--prompt_embeds", str(f["nan_embeds"]), *small],
        ),
        (
            "FLUX checkpoint: int32 embeddings",
            ["--weights", str(f["flux_transformer"]), "--prompt_embeds", str(f["int_embeds"]), *small],
        ),
        # Found by probing after the issue was closed (see tests/test_reliability_generate.py).
        ("tiny: a prompt of separators only", ["--prompt", ",,,", "--steps", "1"]),
        ("tiny: --seed -1", ["--seed", "-1", "--steps", "1"]),
        ("tiny: --steps 1000000000", ["--steps", "1000000000"]),
        ("tiny: --initialization_timeout nan", ["--initialization_timeout", "nan", "--steps", "1"]),
        (
            "tiny: negative prompt of three digits",
            ["--prompt", "12", "--negative_prompt", "345", "--steps", "1"],
        ),
        ("tiny: --guidance_scale (no guidance embedding)", ["--guidance_scale", "3", "--steps", "1"]),
        ("tiny: 10 digits over --data_parallel_degree 3", ["--data_parallel_degree", "3", "--steps", "1"]),
        ("output name of 300 bytes", ["--steps", "1", "--output", "a" * 300 + ".png"]),
        ("FLUX: escape sequence in the prompt", [*flux, *small, "--prompt", "a \x1b[31mred\x1b[0m cube"]),
        ("FLUX: one picture over --data_parallel_degree 2", [*flux, *small, "--data_parallel_degree", "2"]),
    ]


def run_case(tree: Path, argv: list[str], work: Path, says: str | None) -> tuple[str, list[str]]:
    folder = Path(tempfile.mkdtemp(dir=work, prefix="case-"))
    (folder / "a-file").write_text("not a folder")
    before = set(folder.rglob("*"))
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu", JAXDIT_COMPILATION_CACHE="0")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "jaxdit.cli", "generate", *argv],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        return "hang", []
    left = sorted(str(p.relative_to(folder)) for p in set(folder.rglob("*")) - before)
    # Progress bars (tqdm's \r-separated updates) are not messages.
    err = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("denoising")]
    if "Traceback" in done.stderr:
        return "traceback", left
    if done.returncode == 0:
        return ("ok", []) if says is not None and says in done.stdout else ("silent", left)
    if done.returncode == 2 and len(err) == 1 and not left:
        return "clear", left
    return "unhelpful", left


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, default=ROOT, help="the jaxdit source tree to run")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaxdit-probe-") as work:
        work = Path(work)
        counts: collections.Counter[str] = collections.Counter()
        leftovers = 0
        for name, argv in cases(_folders(work)):
            outcome, left = run_case(args.tree.resolve(), argv, work, VALID.get(name))
            counts[outcome] += 1
            leftovers += bool(left)
            print(f"{outcome:10s} {name}" + (f"  (left: {', '.join(left)})" if left else ""), flush=True)
    total = sum(counts.values())
    summary = ", ".join(
        f"{counts[k]} {k}" for k in ("clear", "ok", "traceback", "unhelpful", "silent", "hang")
    )
    print(f"{total} inputs: {summary}; {leftovers} left files behind")
    return 0


if __name__ == "__main__":
    sys.exit(main())
