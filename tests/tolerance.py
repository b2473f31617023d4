"""The test suite's numerical bounds, written once: one per kind of comparison, with what was measured.

Policy (docs/testing.md says the same for readers of the docs):

- An error is the max absolute difference over all elements. A *relative* bound is multiplied by the
  reference's max absolute value, because fp32 rounding is relative to the values' scale and the tiny
  models' outputs here range from ~1 (pictures) to ~8 (Wan latents); an *absolute* bound is used where the
  scale is fixed (pixels in [0, 1]) or meaningless (quantities that should be 0).
- A bound is 2-3x the largest error measured for its kind over every case the suite runs (2026-12-01,
  jax 0.10.2, torch 2.13.0 CPU, a 2-core x86 host; the values are in each bound's ``measured``). A few-x
  regression fails; another CPU's rounding does not. The mutations of ``scripts/mutation_check.py`` (a
  LayerNorm eps ten times too large, a wrong RoPE base, swapped modulation, a dropped padding mask, ...)
  each fail at least one test with these bounds.
- A bound is never raised to make a test pass: a case that needs more is a finding. Measure it, explain
  it, and only then give it its own bound here with the explanation.
- Exact things are compared exactly (``==``), never with a bound: parameters after a layout conversion,
  collective counts and bytes of a compiled program against the cost model, sampler schedules.

``JAXDIT_TOLERANCE_LOG=errors.jsonl pytest ...`` appends one JSON line per check (test, what, bound,
error, scale, allowed, ratio), which is how the ``measured`` values below were collected.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np


@dataclasses.dataclass(frozen=True)
class Bound:
    """A tolerance: ``limit`` (times max |reference| when ``relative``) and what it was set from."""

    name: str
    limit: float
    relative: bool
    measured: str

    def allowed(self, scale: float) -> float:
        return self.limit * scale if self.relative else self.limit


def max_error(got, want) -> float:
    """max |got - want| in fp32 (shapes must agree)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max())


def check(got, want, bound: Bound, what: str = "") -> float:
    """Asserts ``got`` is within ``bound`` of the reference ``want``; returns (and prints) the error."""
    err = max_error(got, want)
    scale = float(np.abs(np.asarray(want, np.float32)).max())
    return check_error(err, bound, scale, what)


def check_error(err: float, bound: Bound, scale: float = 1.0, what: str = "") -> float:
    """Asserts an already computed error is within ``bound`` (``scale``: max |reference|, for relative
    bounds); returns it."""
    err, scale = float(err), float(scale)
    allowed = bound.allowed(scale)
    _record(bound, err, scale, allowed, what)
    print(f"{what or bound.name}: max |difference| {err:.2e} (bound {bound.name}: {allowed:.2e})")
    if not err <= allowed:  # also fails on NaN
        raise AssertionError(
            f"{what or 'error'} {err:.3e} exceeds {bound.name} = {allowed:.3e}"
            + (f" ({bound.limit:g} x max |reference| {scale:.3g})" if bound.relative else "")
            + f"; measured when the bound was set: {bound.measured}"
        )
    return err


def _record(bound: Bound, err: float, scale: float, allowed: float, what: str) -> None:
    path = os.environ.get("JAXDIT_TOLERANCE_LOG")
    if not path:
        return
    line = dict(
        test=os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
        what=what,
        bound=bound.name,
        error=err,
        scale=scale,
        allowed=allowed,
        ratio=err / allowed if allowed else None,
    )
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


# ---------------------------------------------------------------------------------------------------------
# The bounds. Each names the suite's cases it covers and the largest errors they gave.
# ---------------------------------------------------------------------------------------------------------

#: fp32, the same model sharded over a mesh vs on one device: one forward, or attention alone. The same
#: arithmetic in another order (blockwise attention merged by log-sum-exp, Ulysses' head split, tensor
#: parallelism's partial sums, matmuls of other batch sizes).
SHARDED = Bound(
    "SHARDED",
    2e-6,
    relative=True,
    measured="attention alone 8.2e-7 (ring8, random lengths), Wan 5.5e-7 (data2 x ring2 x ulysses2), "
    "FLUX 3.2e-7 (cfg2 x ulysses4), relative",
)

#: fp32, patch-parallel VAE decode / encode (latent rows over devices, halo rows, GroupNorm sums across
#: tiles, ring attention in the mid block) vs the one-device VAE.
VAE_TILES = Bound(
    "VAE_TILES",
    2.5e-6,
    relative=True,
    measured="Wan VAE decode 8.9e-7 (4 devices), FLUX AE decode 8.2e-7, encode 7.8e-7, relative",
)

#: fp32, one forward against PyTorch (diffusers / transformers) on the same weights and inputs: FLUX
#: without a guidance embedding, the FLUX and Wan VAEs, T5 / umT5 / CLIP text and vision encoders.
TORCH_FORWARD = Bound(
    "TORCH_FORWARD",
    6e-6,
    relative=True,
    measured="FLUX AE decode 2.5e-6, Wan VAE decode 2.4e-6, FLUX schnell 1.5e-6, T5 9.7e-7, relative",
)

#: FLUX-dev against diffusers. Its guidance embedding takes sin / cos of guidance x 1000 (up to 5000
#: here): fp32 spacing there is 4.9e-4, so the two implementations' arguments already differ by that much
#: before any layer runs (the same inputs with guidance 1 measure 3.4e-6).
TORCH_FORWARD_GUIDANCE_EMBED = Bound(
    "TORCH_FORWARD_GUIDANCE_EMBED",
    1.5e-5,
    relative=True,
    measured="6.8e-6 relative on every mesh (1.9e-5 on max |out| 2.8)",
)

#: Wan 2.1 against diffusers' WanTransformer3DModel, one forward. Larger than FLUX's and not traced to
#: one op: 2.5e-6 to 7.1e-6 on the same weights over the three latent shapes.
TORCH_FORWARD_WAN = Bound(
    "TORCH_FORWARD_WAN",
    1.5e-5,
    relative=True,
    measured="7.1e-6 (t2v, 5 frames of 4 x 6), 5.0e-6 (i2v), relative",
)

#: Wan's whole denoising loop (4 UniPC steps, CFG 5) against diffusers' WanPipeline: guidance weights
#: the two forwards' differences by -4 and 5, UniPC carries them (tests/test_wan_pipeline.py).
TORCH_LOOP = Bound(
    "TORCH_LOOP",
    1.2e-5,
    relative=True,
    measured="T2V 5.0e-6 on every mesh (3.8e-5 on max |latent| 7.7), I2V 2.6e-6, relative",
)

#: Prompt to pixels against diffusers' pipelines (tests/test_prompt_to_pixels.py), absolute on pixels
#: in [0, 1]. One per pipeline: text encoders, steps and the VAE add up differently in each.
PIXELS = {
    "flux": Bound("PIXELS[flux]", 1.5e-5, relative=False, measured="6.4e-6 (cfg2 x ring2 x ulysses2)"),
    "wan": Bound("PIXELS[wan]", 6e-6, relative=False, measured="2.3e-6 (cfg2 x ulysses2)"),
    "wan_i2v": Bound("PIXELS[wan_i2v]", 4.5e-5, relative=False, measured="1.9e-5 (ring2 x ulysses2)"),
}

#: A whole generation (every denoising step) on another mesh vs on one device, fp32, the same seed:
#: the sharded forwards' rounding (SHARDED) carried through the steps and the guidance.
SAME_SEED = Bound(
    "SAME_SEED",
    4e-6,
    relative=True,
    measured="tiny-digits 1.7e-6 (6 steps, cfg2 x ring2 x ulysses2; make demo's 20 steps: 1.7e-6 on |x| ~1), "
    "PipeFusion warm-up only 1.5e-6 (FLUX), 1.2e-6 (Wan I2V), Wan 1.1e-6 (CLI vs library), relative",
)

#: PipeFusion's pipelined phase (stale K/V) vs a serial reference of the same semantics written on the
#: unsharded model (full softmax over fresh + buffered K/V, no log-sum-exp merge), fp32, a few steps with
#: CFG. (Warm-up only is the serial computation on another mesh: SAME_SEED.)
PIPEFUSION = Bound(
    "PIPEFUSION",
    4e-6,
    relative=True,
    measured="FLUX (tiny-digits) 1.5e-6, Wan 1.1e-6 (pipefusion4 x ring2), relative",
)

#: Samplers against diffusers' schedulers, every step of a full run fed the same random model outputs,
#: relative to that step's sample (tests/test_samplers.py): float32 arithmetic in another order.
SAMPLER = Bound(
    "SAMPLER",
    3e-6,
    relative=True,
    measured="UniPC 1.4e-6 (order 2, 50 steps), flow-match Euler 1.7e-7, relative",
)

#: bf16 weights and matmuls (norms, RoPE, modulation, softmax statistics in fp32) against the fp32
#: reference, one forward: 8 bf16 units in the last place (2^-8) of the output's scale.
BF16 = Bound(
    "BF16",
    8 * 2.0**-8,
    relative=True,
    measured="T5 encoder 1.4e-2 (3.7 ulps), FLUX-dev 7.7e-3, Wan 6.9e-3, relative",
)
