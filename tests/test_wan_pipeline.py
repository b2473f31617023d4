"""WanPipeline: the whole denoising loop equals diffusers', the same seed gives the same latents on every
mesh, the compiled step exchanges one prediction for CFG, and ``jaxdit generate`` rejects bad Wan flags.

The model is the tiny random diffusers ``WanTransformer3DModel`` of tests/wan_tiny.py (8 heads, 2 blocks),
saved with ``save_pretrained`` and loaded through ``WanPipeline.from_checkpoint``. The T2V reference is
diffusers' own ``WanPipeline`` (pipelines/wan/pipeline_wan.py) with that transformer and a
``UniPCMultistepScheduler``, given the same text embeddings and initial noise and asked for latents (no
text encoder or VAE runs). The I2V reference is ``WanImageToVideoPipeline``'s loop written out here:
that pipeline builds its condition latents from a picture with its own VAE, while this test feeds
condition latents directly (the whole I2V pipeline, picture to pixels, is tests/test_prompt_to_pixels.py).

The video is 9 frames at 48x80 pixels: a [2, 4, 3, 6, 10] latent, 45 video tokens, which 4 and 8 sequence
shards do not divide (the padded layout is exercised). 4 steps of UniPC with CFG (guidance 5) and shift 3.

Bounds (tests/tolerance.py): TORCH_LOOP against diffusers, SAME_SEED across meshes. Why the loop's error
is what it is: one jaxdit forward differs from diffusers' by ~1e-5 on this model; guidance
``u + g (c - u)`` combines two forwards with weights 1 - g and g, so the guided prediction differs by up
to (2g - 1) x that. UniPC's weights on the predictions stay below 1 in size, so the latents inherit at
most the prediction's error, and the sampler's own float32 difference from diffusers is ~1e-6 of the
scale (tests/test_samplers.py). Across meshes the noise is the seed's and nothing else, and the sharded
forwards equal the unsharded one within tolerance.SHARDED (tests/test_wan_vs_diffusers.py).
"""

import functools
import re
import subprocess
import sys
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tolerance as tol
import torch
import wan_tiny
from diffusers import UniPCMultistepScheduler
from diffusers import WanPipeline as DiffusersWanPipeline

from jaxdit import cli, hlo_stats
from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines.wan import WanPipeline, check_inputs, default_flow_shift

#: Quick CPU compiles (as the other Wan tests): numerics are what is tested, not XLA's optimiser.
FAST = {"xla_backend_optimization_level": 0}

BATCH, STEPS, GUIDANCE, SHIFT, SEED = 2, 4, 5.0, 3.0, 0
FRAMES, HEIGHT, WIDTH = 9, 48, 80  # latent [B, 4, 3, 6, 10]: 45 tokens
LATENT = (BATCH, wan_tiny.OUT_CHANNELS, 3, 6, 10)
#: I2V's text is 512 tokens (diffusers splits image from text at L - 512): one video keeps it quick.
I2V_BATCH = 1

MESHES = {
    "single": ParallelConfig(),
    "data2_ulysses4": ParallelConfig(data=2, ulysses=4),
    "ring2_ulysses4": ParallelConfig(ring=2, ulysses=4),
    "cfg2_ulysses4": ParallelConfig(cfg=2, ulysses=4),
    "cfg2_ring2_tensor2": ParallelConfig(cfg=2, ring=2, tensor=2),
}


@functools.cache
def _conditioning(i2v: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    batch = I2V_BATCH if i2v else BATCH
    text = (batch, wan_tiny.text_len(i2v), wan_tiny.TEXT_DIM)
    out = {
        "prompt_embeds": rng.standard_normal(text).astype(np.float32),
        "negative_prompt_embeds": rng.standard_normal(text).astype(np.float32),
    }
    if i2v:
        extra = wan_tiny.in_channels(True) - wan_tiny.OUT_CHANNELS
        image = (batch, wan_tiny.IMAGE_TOKENS, wan_tiny.IMAGE_DIM)
        out["image_embeds"] = rng.standard_normal(image).astype(np.float32)
        out["condition"] = rng.standard_normal((batch, extra, *LATENT[2:])).astype(np.float32)
    return out


def _call_kwargs(i2v: bool = False) -> dict:
    return dict(
        _conditioning(i2v),
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        flow_shift=SHIFT,
        seed=SEED,
    )


def _scheduler() -> UniPCMultistepScheduler:
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=SHIFT)


@functools.cache
def _reference(i2v: bool) -> np.ndarray:
    """T2V: diffusers' ``WanPipeline`` itself; I2V: ``WanImageToVideoPipeline.__call__``'s loop written out
    (see the module docstring). Both on the seed's noise."""
    model = wan_tiny.model(i2v)
    c = {k: torch.from_numpy(v) for k, v in _conditioning(i2v).items()}
    batch = I2V_BATCH if i2v else BATCH
    latents = torch.from_numpy(latent_ops.initial_noise(SEED, (batch, *LATENT[1:])))
    if not i2v:
        pipe = DiffusersWanPipeline(
            tokenizer=None, text_encoder=None, transformer=model, vae=None, scheduler=_scheduler()
        )
        with torch.no_grad():
            out = pipe(
                prompt_embeds=c["prompt_embeds"],
                negative_prompt_embeds=c["negative_prompt_embeds"],
                latents=latents,
                height=HEIGHT,
                width=WIDTH,
                num_frames=FRAMES,
                num_inference_steps=STEPS,
                guidance_scale=GUIDANCE,
                output_type="latent",
            )
        return out.frames.numpy()
    scheduler = _scheduler()
    scheduler.set_timesteps(STEPS)
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = torch.cat([latents, c["condition"]], dim=1)
            common = dict(hidden_states=x, timestep=t.expand(batch))
            common["encoder_hidden_states_image"] = c["image_embeds"]
            cond = model(**common, encoder_hidden_states=c["prompt_embeds"]).sample
            uncond = model(**common, encoder_hidden_states=c["negative_prompt_embeds"]).sample
            guided = uncond + GUIDANCE * (cond - uncond)
            latents = scheduler.step(guided, t, latents).prev_sample
    return latents.numpy()


@functools.cache
def _pipeline(config: ParallelConfig, i2v: bool = False) -> WanPipeline:
    return WanPipeline.from_checkpoint(wan_tiny.diffusers_folder(i2v), config, compiler_options=FAST)


@functools.cache
def _generate(name: str) -> np.ndarray:
    out = _pipeline(MESHES[name])(**_call_kwargs(), output_type="latent", progress=False)
    assert out.images is None and out.latents.shape == LATENT and out.latents.dtype == np.float32
    return out.latents


def test_loop_matches_diffusers():
    tol.check(
        _generate("single"), _reference(False), tol.TORCH_LOOP, "single device vs diffusers' WanPipeline"
    )


@pytest.mark.parametrize("name", [n for n in MESHES if n != "single"])
def test_same_seed_same_latents_on_every_mesh(name):
    out = _generate(name)
    tol.check(out, _generate("single"), tol.SAME_SEED, f"{name} vs one device")
    tol.check(out, _reference(False), tol.TORCH_LOOP, f"{name} vs diffusers' WanPipeline")


def test_i2v_matches_diffusers():
    """I2V: condition tokens beside the noise, CLIP features in both branches; CFG, ring and ulysses."""
    pipe = _pipeline(ParallelConfig(cfg=2, ring=2, ulysses=2), i2v=True)
    out = pipe(**_call_kwargs(i2v=True), output_type="latent", progress=False)
    tol.check(out.latents, _reference(True), tol.TORCH_LOOP, "i2v cfg2_ring2_ulysses2 vs diffusers' loop")


def test_cfg_step_exchanges_one_prediction():
    """The compiled step = the model's own collectives + one permute of one prediction over cfg."""
    config = MESHES["cfg2_ring2_tensor2"]  # the model brings ring permutes and tensor all-reduces too
    pipe = _pipeline(config)
    step = hlo_stats.collectives(pipe.lower_step(**_call_kwargs()).compile())

    tokens, features = 45, wan_tiny.config(False).patch_features
    local = -(-tokens // config.sequence_degree)  # this device's tokens, padding included
    f32 = jnp.float32
    shapes = dict(
        hidden_states=jax.ShapeDtypeStruct((2 * BATCH, tokens, features), f32),
        positions=jax.ShapeDtypeStruct((tokens, 3), jnp.int32),
        timestep=jax.ShapeDtypeStruct((2 * BATCH,), f32),
        encoder_hidden_states=jax.ShapeDtypeStruct((2 * BATCH, 7, wan_tiny.TEXT_DIM), f32),
    )
    model = hlo_stats.collectives(pipe.forward.lower(**shapes).compile())
    key = lambda c: (c.kind, c.count, c.operand_shapes, c.source_target_pairs, c.replica_groups)
    extra = Counter(map(key, step)) - Counter(map(key, model))
    missing = Counter(map(key, model)) - Counter(map(key, step))
    assert not missing, missing
    assert sum(extra.values()) == 1, extra
    ((kind, count, operands, pairs, _),) = extra
    assert (kind, count) == ("collective-permute", 1)
    # One branch's prediction shard: its BATCH requests x this device's tokens x their features, fp32.
    assert sum(s.nbytes for s in operands) == BATCH * local * features * 4
    # Each device swaps with the device holding the other branch of the same tokens (cfg coordinate).
    ids = np.arange(config.num_devices).reshape(pipe.mesh.devices.shape)
    partner = np.flip(ids, axis=pipe.mesh.axis_names.index("cfg"))
    assert set(pairs) == set(zip(ids.ravel().tolist(), partner.ravel().tolist(), strict=True))


def test_check_inputs_errors():
    config = wan_tiny.config(False)
    ok = dict(
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        prompt_embeds=(2, 7, 16),
        negative_prompt_embeds=(2, 7, 16),
    )
    plan = check_inputs(config, ParallelConfig(cfg=2, ulysses=4), **ok)
    assert plan.latent_shape == LATENT and plan.cfg and plan.flow_shift == 3.0
    assert default_flow_shift(720, 1280) == 5.0 and default_flow_shift(480, 832) == 3.0
    cases = [
        (dict(num_frames=8), "num_frames 8 must be 4n \\+ 1.*nearest: 5 or 9"),
        (dict(height=40), "height 40 must be a positive multiple of 16.*nearest: 32 or 48"),
        (dict(negative_prompt_embeds=None), "needs negative conditioning"),
        (dict(negative_prompt_embeds=(2, 9, 16)), "differ from prompt_embeds"),
        (dict(guidance_scale=1.0), "cfg=2 .*guidance_scale 1.0 <= 1"),
        (dict(prompt_embeds=(2, 7, 12), negative_prompt_embeds=(2, 7, 12)), r"expected \[B, T, 16\]"),
        (dict(image_embeds=(2, 5, 24)), "for I2V models"),
        (dict(latents=(2, 4, 3, 6, 8)), "this request needs"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            check_inputs(config, ParallelConfig(cfg=2, ulysses=4), **{**ok, **change})
    with pytest.raises(ValueError, match="8 heads cannot be split"):
        check_inputs(config, ParallelConfig(ulysses=3), **ok)
    with pytest.raises(ValueError, match="needs image_embeds"):
        check_inputs(wan_tiny.config(True), ParallelConfig(), **ok)


# --------------------------------------------------------------------------------------------------------
# jaxdit generate --model wan...
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embeds(tmp_path_factory):
    """Embedding files for the full-size presets (only their headers are read by the checks)."""
    folder = tmp_path_factory.mktemp("wan-embeds")
    rng = np.random.default_rng(0)
    text = rng.standard_normal((1, 512, 4096)).astype(np.float16)
    np.savez(folder / "both.npz", prompt_embeds=text, negative_prompt_embeds=text)
    np.savez(folder / "positive.npz", prompt_embeds=text)
    np.savez(folder / "typo.npz", prompt_embeds=text, negative_embeds=text)
    np.savez(folder / "narrow.npz", prompt_embeds=text[..., :768], negative_prompt_embeds=text[..., :768])
    weights = folder / "weights"
    weights.mkdir()
    return folder


def _wan_args(embeds, *extra: str, model: str = "wan2.1-t2v-1.3b", file: str = "both.npz") -> list[str]:
    return [
        "generate",
        "--model",
        model,
        "--weights",
        str(embeds / "weights"),
        "--prompt_embeds",
        str(embeds / file),
        *extra,
    ]


@pytest.mark.parametrize(
    "extra, file, model, message",
    [
        (["--num_frames", "80"], "both.npz", None, "num_frames 80 must be 4n \\+ 1.*77 or 81"),
        (["--height", "488"], "both.npz", None, "height 488 must be a positive multiple of 16"),
        (["--use_cfg_parallel", "--ulysses_degree", "2"], "positive.npz", None, "negative_prompt_embeds"),
        (["--use_cfg_parallel", "--guidance_scale", "1"], "both.npz", None, "cfg=2 .*guidance_scale 1.0"),
        (["--ulysses-degree", "8"], "both.npz", None, "12 heads cannot be split over ulysses=8"),
        ([], "narrow.npz", None, r"expected \[B, T, 4096\]"),
        ([], "typo.npz", None, "negative_embeds"),
        ([], "both.npz", "wan2.1-i2v-14b", "needs image_embeds"),
        (["--true_cfg_scale", "4"], "both.npz", None, "--guidance_scale"),
        (["--output", "video.png"], "both.npz", None, ".npy"),
        (["--flow_shift", "0"], "both.npz", None, "flow_shift must be > 0"),
        (
            ["--pipefusion_parallel_degree", "2", "--num_pipeline_patch", "4"],
            "both.npz",
            None,
            "30 latent rows",
        ),
    ],
)
def test_cli_wan_errors(embeds, capsys, extra, file, model, message):
    argv = _wan_args(embeds, *extra, model=model or "wan2.1-t2v-1.3b", file=file)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdit generate: error:")
    assert re.search(message, err), err


def test_cli_wan_needs_weights_and_embeddings(embeds, capsys):
    assert (
        cli.main(["generate", "--model", "wan2.1-t2v-14b", "--prompt_embeds", str(embeds / "both.npz")]) == 2
    )
    assert "needs --weights" in capsys.readouterr().err
    assert cli.main(["generate", "--model", "wan2.1-t2v-14b", "--weights", str(embeds / "weights")]) == 2
    assert "--prompt_embeds" in capsys.readouterr().err
    # Wan flags on a FLUX-architecture model.
    assert cli.main(["generate", "--num_frames", "81"]) == 2
    assert "--num_frames" in capsys.readouterr().err


def test_cli_checks_wan_before_jax_starts(embeds):
    """A valid Wan request passes check_request without any jax backend coming up (a fresh process)."""
    code = f"""
from jaxdit.cli import build_parser
from jaxdit.generate import GenerateRequest, check_request
args = build_parser().parse_args({_wan_args(embeds, "--use_cfg_parallel", "--ulysses_degree", "4")!r})
check_request(GenerateRequest.from_args(args))
from jax._src import xla_bridge
assert not xla_bridge._backends, xla_bridge._backends
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_cli_generates_wan_latents(tmp_path, monkeypatch, capsys):
    """``jaxdit generate --model wan...`` end to end on the tiny model (registered as the preset it
    claims to be): the file's embeddings, the Wan flags and the mesh flags reach the pipeline."""
    from jaxdit.models.wan import WanConfig

    monkeypatch.setitem(WanConfig.PRESETS, "wan2.1-t2v-1.3b", wan_tiny.config(False).to_json())
    np.savez(tmp_path / "embeds.npz", **_conditioning(False))
    out = tmp_path / "latents.npy"
    argv = ["generate", "--model", "wan2.1-t2v-1.3b", "--weights", str(wan_tiny.diffusers_folder(False))]
    argv += ["--prompt_embeds", str(tmp_path / "embeds.npz"), "--output", str(out), "--seed", str(SEED)]
    argv += ["--num_frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]
    argv += ["--steps", str(STEPS), "--flow_shift", str(SHIFT), "--use_cfg_parallel", "--ulysses-degree", "4"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    tol.check(np.load(out), _generate("cfg2_ulysses4"), tol.SAME_SEED, "jaxdit generate vs the library call")
    # The preset is checked against the checkpoint's config before any tensor is read.
    with pytest.raises(ValueError, match=r"is not wan2.1-t2v-14b: dim=96 \(preset: 5120\)"):
        WanPipeline.from_checkpoint(wan_tiny.diffusers_folder(False), preset="wan2.1-t2v-14b")
