"""Wan 2.2 from a prompt to an MP4 through ``jaxdit generate``, against diffusers running the same folder.

tests/tiny_pipelines.py writes tiny random Wan 2.2 pipelines with ``save_pretrained`` as the hub lays them
out: T2V-A14B (``WanPipeline``, two experts, boundary 0.875), I2V-A14B (``WanImageToVideoPipeline``, two
36-channel experts without an image encoder, boundary 0.9) and TI2V-5B (``WanPipeline`` with
``expand_timesteps`` and a Wan 2.2 VAE: residual blocks, 2x2 patchify, 48 channels); and the same weights
in Wan-AI's original layout (``high_noise_model/`` + ``low_noise_model/`` + ``Wan2.1_VAE.pth``; TI2V with
``Wan2.2_VAE.pth``). diffusers runs each in PyTorch (its in-memory pipeline: reloading a saved one needs
``accelerate``); ``jaxdit generate`` runs the folder on a mesh of emulated devices with the same prompt,
negative prompt and initial noise (diffusers takes the seed's noise as ``latents``), writes the MP4, and the
pixels it wrote are compared with diffusers' (``tolerance.PIXELS``, one bound per variant). The expert each step ran
is recorded on both sides: the switch happens at the same step (3 steps at shift 3: t = 1000, 857, 600,
so step 1 for both boundaries).

Measured (2026-12, fp32, max |pixel error| on [0, 1]): T2V-A14B cfg2 x ulysses2 1.3e-5; I2V-A14B
ring2 x ulysses2 2.1e-5; TI2V image-to-video cfg2 x ring2 x ulysses2 1.3e-6; original layouts: T2V-A14B
ring2 x ulysses2 with the idle expert offloaded 1.3e-5, TI2V text-to-video ring2 x ulysses2 3.5e-6.
Each test is ~25-60 s on a 2-core CPU (compiles: umT5, the transformer step, the VAE decode/encode).
"""

import functools

import numpy as np
import pytest
import tiny_pipelines
import tolerance as tol
import torch
from PIL import Image

from jaxdit import cli
from jaxdit import generate as generate_module
from jaxdit.pipelines import latents as latent_ops
from jaxdit.pipelines import wan_experts
from jaxdit.pipelines.wan import WanPipeline

av = pytest.importorskip("av")

FAST = {"xla_backend_optimization_level": 0}
PROMPT, NEGATIVE = "a small red cube", "static"
STEPS, FRAMES, SEED, GUIDANCE, GUIDANCE_2 = 3, 5, 0, 5.0, 3.0
#: (height, width) per variant: the Wan 2.1 VAE's 8x for A14B, the Wan 2.2 VAE's 16x (x 2x2 patches) for TI2V.
SIZES = {"t2v": (48, 64), "i2v": (48, 64), "ti2v": (64, 96)}
#: Diffusers' switch at these settings (the high-noise expert at step 0 only): 2 calls a step with CFG.
EXPERTS = (0, 1, 1)


def _latent_shape(variant: str) -> tuple[int, ...]:
    h, w = SIZES[variant]
    s, z = (16, tiny_pipelines.TI2V_Z) if variant == "ti2v" else (8, 16)
    return (1, z, (FRAMES - 1) // 4 + 1, h // s, w // s)


@functools.cache
def _picture(variant: str) -> np.ndarray:
    h, w = SIZES[variant]
    return np.random.default_rng(5).integers(0, 256, (h, w, 3), dtype=np.uint8)


@functools.cache
def reference(variant: str, image: bool) -> tuple[np.ndarray, tuple[int, ...]]:
    """diffusers' frames [1, F, H, W, 3] in [0, 1] and the expert of each step (0 high, 1 low)."""
    _, pipe, _ = tiny_pipelines.wan22(variant)
    if image:
        pipe = tiny_pipelines.wan22_image_pipeline(variant)
    calls = []
    hooks = [
        getattr(pipe, name).register_forward_pre_hook(lambda *_, i=i: calls.append(i))
        for i, name in enumerate(("transformer", "transformer_2"))
        if getattr(pipe, name, None) is not None
    ]
    h, w = SIZES[variant]
    kwargs = dict(guidance_scale_2=GUIDANCE_2) if variant != "ti2v" else {}
    if image:
        kwargs["image"] = Image.fromarray(_picture(variant))
    try:
        with torch.no_grad():
            frames = pipe(
                prompt=PROMPT,
                negative_prompt=NEGATIVE,
                height=h,
                width=w,
                num_frames=FRAMES,
                num_inference_steps=STEPS,
                guidance_scale=GUIDANCE,
                latents=torch.from_numpy(latent_ops.initial_noise(SEED, _latent_shape(variant))),
                max_sequence_length=16,
                output_type="np",
                **kwargs,
            ).frames
    finally:
        for hook in hooks:
            hook.remove()
    return frames, tuple(calls[::2])  # cond and uncond run the same expert


def _generate(monkeypatch, tmp_path, folder, variant: str, mesh: list[str], *extra: str):
    """``jaxdit generate`` on ``folder``: (the pixels it wrote in [0, 1], the MP4's frames and rate, the
    expert of each step)."""
    seen, picks = {}, []
    write = generate_module.write

    def capture(r, result):
        seen["images"] = result.images
        return write(r, result)

    params = wan_experts.TwoExperts.params

    def record(self, expert):
        picks.append(expert)
        return params(self, expert)

    monkeypatch.setattr(generate_module, "write", capture)
    monkeypatch.setattr(wan_experts.TwoExperts, "params", record)
    # Quick CPU compiles, as the other pipeline tests (the CLI has no flag for XLA options).
    load = WanPipeline.from_pretrained.__func__

    @functools.wraps(load)  # keeps the signature, which jaxdit generate reads
    def quick(cls, *args, **kwargs):
        return load(cls, *args, compiler_options=FAST, **kwargs)

    monkeypatch.setattr(WanPipeline, "from_pretrained", classmethod(quick))
    h, w = SIZES[variant]
    out = tmp_path / f"{variant}.mp4"
    argv = ["generate", "--weights", str(folder), "--prompt", PROMPT, "--negative_prompt", NEGATIVE]
    argv += ["--height", str(h), "--width", str(w), "--num_frames", str(FRAMES), "--steps", str(STEPS)]
    argv += ["--guidance_scale", str(GUIDANCE), "--seed", str(SEED), "--max_sequence_length", "16"]
    assert cli.main([*argv, *mesh, *extra, "--output", str(out)]) == 0
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return (seen["images"] + 1) / 2, (len(frames), *frames[0].shape), rate, tuple(picks)


def _check(variant, video, mp4, rate, picks, ref, ref_experts, name, pipefusion=False):
    if not pipefusion:
        # Denoiser.run asks for step 0's parameters once more before the loop (to record the step's shapes).
        picks = picks[1:]
    print(f"{name}: experts per step {picks} (diffusers {ref_experts})")
    h, w = SIZES[variant]
    assert video.shape == ref.shape == (1, FRAMES, h, w, 3)
    assert mp4 == (FRAMES, h, w, 3) and rate == (24 if variant == "ti2v" else 16)
    tol.check(video, ref, tol.PIXELS[f"wan22_{variant}"], f"{name}: pixels vs diffusers")
    if variant != "ti2v":
        assert ref_experts == EXPERTS
        # PipeFusion asks once per expert segment (its warm-up step and pipelined call share them).
        assert picks == ((0, 1) if pipefusion else EXPERTS)


CASES = {
    "t2v": (["--use_cfg_parallel", "--ulysses_degree", "2"], ["--guidance_scale_2", str(GUIDANCE_2)]),
    "i2v": (["--ring_degree", "2", "--ulysses_degree", "2"], ["--guidance_scale_2", str(GUIDANCE_2)]),
    "ti2v": (["--use_cfg_parallel", "--ring_degree", "2", "--ulysses_degree", "2"], []),
}


@pytest.mark.parametrize("variant", list(CASES))
def test_diffusers_folder_prompt_to_mp4_matches_diffusers(variant, monkeypatch, tmp_path):
    folder, _, _ = tiny_pipelines.wan22(variant)
    image = variant != "t2v"
    extra = list(CASES[variant][1])
    if image:
        path = tmp_path / "first_frame.png"
        Image.fromarray(_picture(variant)).save(path)
        extra += ["--image", str(path)]
    ref, ref_experts = reference(variant, image)
    result = _generate(monkeypatch, tmp_path, folder, variant, CASES[variant][0], *extra)
    _check(variant, *result, ref, ref_experts, f"Wan 2.2 {variant} ({' '.join(CASES[variant][0])})")


def test_original_a14b_folder_with_the_idle_expert_offloaded(monkeypatch, tmp_path):
    # Wan-AI's layout: its T2V flow shift (12) is the release's; the same noise schedule as the diffusers
    # folder's (3) is asked for explicitly.
    folder = tiny_pipelines.wan22_original("t2v")
    ref, ref_experts = reference("t2v", False)
    mesh = ["--ring_degree", "2", "--ulysses_degree", "2"]
    extra = ["--guidance_scale_2", str(GUIDANCE_2), "--offload_idle_expert", "--flow_shift", "3.0"]
    result = _generate(monkeypatch, tmp_path, folder, "t2v", mesh, *extra)
    _check("t2v", *result, ref, ref_experts, "Wan 2.2 t2v original layout, idle expert offloaded")


def test_original_ti2v_folder_text_to_video(monkeypatch, tmp_path):
    folder = tiny_pipelines.wan22_original("ti2v")
    ref, _ = reference("ti2v", False)
    mesh = ["--ring_degree", "2", "--ulysses_degree", "2"]
    result = _generate(monkeypatch, tmp_path, folder, "ti2v", mesh, "--flow_shift", "3.0")
    _check("ti2v", *result, ref, (), "Wan 2.2 ti2v original layout (Wan2.2_VAE.pth), text to video")


def test_pipefusion_two_experts_prompt_to_mp4_matches_diffusers(monkeypatch, tmp_path):
    """PipeFusion (pipefusion2 x ulysses2, 3 patches of one latent row) with every step a warm-up step:
    the plain loop's computation, each expert segment with its own parameters and guidance scale, the
    idle expert offloaded to host memory."""
    folder, _, _ = tiny_pipelines.wan22("t2v")
    ref, ref_experts = reference("t2v", False)
    mesh = ["--pipefusion_parallel_degree", "2", "--ulysses_degree", "2", "--warmup_steps", str(STEPS)]
    extra = ["--guidance_scale_2", str(GUIDANCE_2), "--offload_idle_expert"]
    result = _generate(monkeypatch, tmp_path, folder, "t2v", mesh, *extra)
    _check("t2v", *result, ref, ref_experts, "Wan 2.2 t2v, PipeFusion warm-up only", pipefusion=True)
