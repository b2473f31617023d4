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
    "FLUX 3.2e-7 (cfg2 x ulysses4), Wan 2.2 per-token timesteps 2.8e-7 (ring2 x ulysses4), PipeFusion's ring "
    "keeping its K/V blocks 2.2e-7, relative",
)

#: fp32, patch-parallel VAE decode / encode (latent rows over devices, halo rows, GroupNorm sums across
#: tiles, ring attention in the mid block) vs the one-device VAE.
VAE_TILES = Bound(
    "VAE_TILES",
    2.5e-6,
    relative=True,
    measured="Wan 2.2 VAE decode 1.2e-6 (2 devices), Wan VAE decode 8.9e-7 (4 devices), FLUX AE decode "
    "8.2e-7, encode 7.8e-7, relative",
)

#: fp32, ``decode_latents`` of latents normalised in numpy (``(z - mean) / std``) against ``decode`` of the
#: raw latents: jaxdit undoes the normalisation in fp32, so the decoder's input moves by about one rounding,
#: and the tiny random decoders (gammas and biases perturbed) amplify it ~10x. Wan 2.2's VAE gives 2.5x
#: Wan 2.1's; the tiles' bound would have held it with a margin of 1.3 only.
DECODE_LATENTS = Bound(
    "DECODE_LATENTS",
    5e-6,
    relative=True,
    measured="Wan 2.2 VAE 1.9e-6, Wan 2.1 VAE 7.4e-7, relative",
)

#: fp32, one forward against PyTorch (diffusers / transformers) on the same weights and inputs: FLUX
#: without a guidance embedding, the FLUX and Wan VAEs, T5 / umT5 / CLIP text and vision encoders.
TORCH_FORWARD = Bound(
    "TORCH_FORWARD",
    6e-6,
    relative=True,
    measured="FLUX AE decode 2.5e-6, Wan VAE decode 2.4e-6, Wan 2.2 VAE decode 1.9e-6, FLUX schnell 1.5e-6, "
    "T5 9.7e-7, relative",
)

#: FLUX-dev against diffusers. Its guidance embedding takes sin / cos of guidance x 1000 (up to 5000
#: here): fp32 spacing there is 4.9e-4, so the two implementations' arguments already differ by that much
#: before any layer runs (the same inputs with guidance 1 measure 3.4e-6). Also FLUX-dev with LoRAs fused
#: (tests/test_lora_flux.py, every layout, against diffusers' ``fuse_lora``): fusing adds little.
TORCH_FORWARD_GUIDANCE_EMBED = Bound(
    "TORCH_FORWARD_GUIDANCE_EMBED",
    1.5e-5,
    relative=True,
    measured="6.8e-6 relative on every mesh (1.9e-5 on max |out| 2.8); with a fused LoRA 7.5e-6 (kohya), "
    "6.3e-6 (PEFT)",
)

#: Wan 2.1 against diffusers' WanTransformer3DModel, one forward. Larger than FLUX's and not traced to
#: one op: 2.5e-6 to 7.1e-6 on the same weights over the three latent shapes. Also Wan 2.2's per-token
#: timesteps (TI2V) and Wan with LoRAs fused (against diffusers' ``fuse_lora``).
TORCH_FORWARD_WAN = Bound(
    "TORCH_FORWARD_WAN",
    1.5e-5,
    relative=True,
    measured="7.1e-6 (t2v, 5 frames of 4 x 6), 5.0e-6 (i2v), per-token timesteps 3.0e-6, with a fused LoRA "
    "2.7e-6, relative",
)

#: A whole denoising loop against diffusers' pipeline on the same weights and noise, the final latents:
#: guidance weights the two forwards' differences (by -4 and 5 at CFG 5), the sampler carries them. Wan
#: (4 UniPC steps, tests/test_wan_pipeline.py), FLUX-dev and Wan with First-Block-Cache against diffusers'
#: (tests/test_cache_diffusers.py: 10 and 6 steps, the same steps skipped), FLUX-dev with two LoRAs through
#: ``jaxdit generate`` (tests/test_lora_generate.py) and Wan 2.2 A14B with a LoRA per expert
#: (tests/test_lora_wan22.py) against diffusers' ``fuse_lora``.
TORCH_LOOP = Bound(
    "TORCH_LOOP",
    1.2e-5,
    relative=True,
    measured="Wan T2V 5.0e-6 on every mesh (3.8e-5 on max |latent| 7.7), I2V 2.6e-6; FLUX-dev two LoRAs 5.0e-6 "
    "(2.9e-5 on 5.7), First-Block-Cache FLUX-dev 4.7e-6 (2.5e-5 on 5.3), Wan 3.2e-6 (1.6e-5 on 5.1); Wan 2.2 a "
    "LoRA per expert 2.3e-6 (1.1e-5 on 4.6), relative",
)

#: Prompt to pixels against diffusers' pipelines (tests/test_prompt_to_pixels.py; Wan 2.2's through
#: ``jaxdit generate`` to an MP4, tests/test_wan22_pipelines.py, both layouts), absolute on pixels in
#: [0, 1]. One per pipeline: text encoders, steps and the VAE add up differently in each.
PIXELS = {
    "flux": Bound("PIXELS[flux]", 1.5e-5, relative=False, measured="6.4e-6 (cfg2 x ring2 x ulysses2)"),
    "wan": Bound("PIXELS[wan]", 6e-6, relative=False, measured="2.3e-6 (cfg2 x ulysses2)"),
    "wan_i2v": Bound("PIXELS[wan_i2v]", 4.5e-5, relative=False, measured="1.9e-5 (ring2 x ulysses2)"),
    "wan22_t2v": Bound(
        "PIXELS[wan22_t2v]",
        3.5e-5,
        relative=False,
        measured="T2V-A14B 1.4e-5 (PipeFusion warm-up only), 1.3e-5 (cfg2 x ulysses2; original layout, offloaded)",
    ),
    "wan22_i2v": Bound(
        "PIXELS[wan22_i2v]", 5e-5, relative=False, measured="I2V-A14B 2.1e-5 (ring2 x ulysses2)"
    ),
    "wan22_ti2v": Bound(
        "PIXELS[wan22_ti2v]",
        1e-5,
        relative=False,
        measured="TI2V-5B text to video 3.5e-6 (original layout), image to video 1.3e-6 (cfg2 x ring2 x ulysses2)",
    ),
    "hunyuanvideo1.5": Bound(
        "PIXELS[hunyuanvideo1.5]",
        1.5e-5,
        relative=False,
        measured="text to video 6.1e-6 (prompt, jaxdit generate, cfg2 x ulysses2), 6.7e-6 (embeddings, ring2 x ulysses2)",
    ),
    # The first frame's VAE latents and SigLIP tokens condition every step: one more encoder's rounding
    # enters the loop, as for Wan I2V.
    "hunyuanvideo1.5_i2v": Bound(
        "PIXELS[hunyuanvideo1.5_i2v]",
        3e-5,
        relative=False,
        measured="image to video 9.3e-6 (jaxdit generate, ring2 x ulysses2), 8.7e-6 (cfg2 x ulysses2)",
    ),
}

#: A whole generation (every denoising step) on another mesh vs on one device, fp32, the same seed:
#: the sharded forwards' rounding (SHARDED) carried through the steps and the guidance.
SAME_SEED = Bound(
    "SAME_SEED",
    4e-6,
    relative=True,
    measured="tiny-digits 1.7e-6 (6 steps, cfg2 x ring2 x ulysses2; make demo's 20 steps: 1.7e-6 on |x| ~1), "
    "with a feature cache 1.6e-6 (tensor2 x cfg2 x ulysses2, TeaCache), PipeFusion warm-up only 1.5e-6 (FLUX), "
    "1.2e-6 (Wan I2V), Wan 1.1e-6 (CLI vs library), Wan TeaCache 6.3e-7 (cfg2 x ring2 x tensor2), relative",
)

#: PipeFusion's pipelined phase (stale K/V) vs a serial reference of the same semantics written on the
#: unsharded model (full softmax over fresh + buffered K/V, no log-sum-exp merge), fp32, a few steps with
#: CFG. (Warm-up only is the serial computation on another mesh: SAME_SEED.)
PIPEFUSION = Bound(
    "PIPEFUSION",
    4e-6,
    relative=True,
    measured="FLUX (tiny-digits) 1.5e-6, Wan 1.1e-6 (pipefusion4 x ring2), with MagCache 1.3e-6 (pipefusion2 x "
    "cfg2), MagCache + Taylor 2.4e-6 (data2 x pipefusion2 x tensor2), TaylorSeer 2.2e-6 (pipefusion2 x "
    "ulysses2), relative",
)

#: Samplers against diffusers' schedulers, every step of a full run fed the same random model outputs,
#: relative to that step's sample (tests/test_samplers.py): float32 arithmetic in another order. Also
#: UniPC stepped from Python (one jitted step) against the scan.
SAMPLER = Bound(
    "SAMPLER",
    3e-6,
    relative=True,
    measured="UniPC 1.4e-6 (order 2, 50 steps), flow-match Euler 1.7e-7, UniPC step by step vs scan 0 "
    "(bit-identical on this CPU), relative",
)

#: bf16 weights and matmuls (norms, RoPE, modulation, softmax statistics in fp32) against the fp32
#: reference, one forward: 8 bf16 units in the last place (2^-8) of the output's scale.
BF16 = Bound(
    "BF16",
    8 * 2.0**-8,
    relative=True,
    measured="T5 encoder 1.4e-2 (3.7 ulps), FLUX-dev 7.7e-3, Wan 6.9e-3, relative",
)


#: Fused attention kernels against the fp32 reference attention (``reference_attention``; the LSE from
#: ``jax.nn.logsumexp``), fp32 inputs: Triton and splash in Pallas' interpreter, alone and merged by Ring
#: inside the real strategies, through PipeFusion's stale K/V and Wan's cross-attention; and the LSE of
#: every kernel (fp32 whatever the inputs). The same softmax in blocks (running max and sum).
KERNEL = Bound(
    "KERNEL",
    1.2e-6,
    relative=True,
    measured="out 4.9e-7 (Triton merged by Ring, ring2 x ulysses4), 3.6e-7 (splash), LSE 1.1e-7 (Triton), "
    "9.6e-8 (cuDNN stand-in), relative",
)

#: bf16 inputs against the fp32 reference attention, output kept in fp32 or rounded to bf16 after an fp32
#: merge: two bf16 roundings at most (the probabilities before the PV matmul, as the XLA kernel does, or a
#: partial's output and then the merged output), each under 2^-8 of the output's scale.
KERNEL_BF16 = Bound(
    "KERNEL_BF16",
    2 * 2.0**-8,
    relative=True,
    measured="3.3e-3 (gpu_check --tiny, XLA, wan-tiny ulysses4), 3.1e-3 (cuDNN stand-in merged by ring8), "
    "1.3e-3 (Triton, interpret), relative",
)

#: bf16 inputs, fp32 arithmetic, the output rounded to bf16 once (the cuDNN adapter): half a bf16 ulp,
#: at most 2^-8 of the value. A proof rather than a measurement: the margin is small by construction and
#: a second rounding anywhere exceeds it.
BF16_ROUNDED_ONCE = Bound(
    "BF16_ROUNDED_ONCE",
    2.0**-8,
    relative=True,
    measured="3.0e-3 (cuDNN stand-in, no mask; 0.76 of the bound), relative",
)

#: Fused LoRA weights (W + scale x B A, in fp32 where the weight lies) against a reference fusion of the
#: same files: on one device vs tensor2 x ulysses2 and PipeFusion's stage slots, a switch vs a fresh fuse,
#: ComfyUI's full deltas vs numpy's base + delta. Relative to each weight's max |value|.
LORA_WEIGHTS = Bound(
    "LORA_WEIGHTS",
    3e-7,
    relative=True,
    measured="switch vs fresh fuse 1.2e-7, ComfyUI deltas vs numpy 1.1e-7, sharded and stage slots vs one "
    "device 0 (bit-identical on this CPU), relative",
)

#: The same computation on inputs or weights one fp32 rounding apart: the output after fuse + unfuse of a
#: LoRA against never fused (every weight back within one rounding), a picture rescaled from uint8 in
#: another order, the latent normalisation against numpy's.
ROUNDING = Bound(
    "ROUNDING",
    1e-6,
    relative=True,
    measured="FLUX-dev forward after fuse, switch, unfuse 3.5e-7; latents after load_lora + unload_lora 1.3e-7; "
    "uint8 picture to [-1, 1] 5.9e-8; normalize_latents 3.3e-8, relative",
)
