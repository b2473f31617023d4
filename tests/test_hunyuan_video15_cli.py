"""HunyuanVideo 1.5 through ``jaxdit generate``: the tiny ``HunyuanVideo15Pipeline`` folder saved by
diffusers with its text encoders (``hunyuan_video15_folder.py``) from a prompt with quoted text to an MP4 on
cfg2 x ulysses2, on ulysses2 x ring2 and on pipefusion2 x ulysses2 (4 emulated devices), against diffusers running the reloaded folder
with the project's noise (numpy ``default_rng(seed).standard_normal`` of [1, 4, F', H/16, W/16]); the CFG scale is the
folder guider's, as diffusers reads it. PipeFusion runs its default 2 patches (one latent row of each
frame) with every step a warm-up step (``--warmup_steps 3``): the whole sequence each step, which is
diffusers' computation; the pipelined steps (stale K/V) are compared with a serial reference of their own
semantics in ``test_hunyuan_video15_pipefusion.py``."""

from __future__ import annotations

import av
import hunyuan_video15_folder as hf
import numpy as np
import pytest
import tolerance as tol
import torch

from jaxdit import cli
from jaxdit import generate as generate_module
from jaxdit.pipelines import latents as latent_ops

PROMPT = 'a cat walks on grass, sign reading "hello"'
H, W, FRAMES, STEPS, SEED = 32, 48, 5, 3, 5


def _folder_and_reference(root, **transformer):
    """The tiny folder (``transformer``: overrides of its transformer's config), diffusers' final latents
    and frames from it, and the ``timestep_r`` of its transformer calls."""
    import diffusers

    folder = root / "HunyuanVideo-1.5-tiny"
    hf.save(folder, with_text=True, **transformer)
    pipe = diffusers.HunyuanVideo15Pipeline.from_pretrained(folder)
    seen_r = []
    pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen_r.append(kwargs.get("timestep_r")), with_kwargs=True
    )
    noise = torch.from_numpy(latent_ops.initial_noise(SEED, (1, 4, (FRAMES - 1) // 4 + 1, H // 16, W // 16)))
    call = dict(height=H, width=W, num_frames=FRAMES, num_inference_steps=STEPS, latents=noise)
    with torch.no_grad():
        latents = pipe(PROMPT, output_type="latent", **call).frames
        video = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
        want_frames = pipe.video_processor.postprocess_video(video, output_type="np")
    return (folder, latents.numpy(), want_frames), seen_r


@pytest.fixture(scope="module")
def folder_and_reference(tmp_path_factory):
    """The tiny folder and diffusers' final latents and frames from it, shared by the meshes."""
    return _folder_and_reference(tmp_path_factory.mktemp("hy"))[0]


MESHES = {
    "cfg2 x ulysses2": ["--use_cfg_parallel", "--ulysses_degree", "2"],
    "ulysses2 x ring2": ["--ulysses_degree", "2", "--ring_degree", "2"],
    "pipefusion2 x ulysses2": ["--pipefusion_parallel_degree", "2", "--ulysses_degree", "2"]
    + ["--warmup_steps", str(STEPS)],
}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_cli_prompt_to_mp4_matches_diffusers(folder_and_reference, mesh, monkeypatch, tmp_path):
    _generate(folder_and_reference, mesh, monkeypatch, tmp_path)


def test_cli_meanflow_prompt_to_mp4_matches_diffusers(tmp_path_factory, monkeypatch, tmp_path):
    """A MeanFlow (``use_meanflow``) folder on cfg2 x ulysses2: diffusers' text-to-video pipeline passes
    no ``timestep_r``, so its transformer leaves the second timestep's term out; jaxdit's does the same
    (the term moves the model's output by far more than the bound: ``test_hunyuan_video15_transformer.py``)."""
    case, seen_r = _folder_and_reference(tmp_path_factory.mktemp("hy-mf"), use_meanflow=True)
    assert seen_r == [None] * (2 * STEPS)  # both CFG branches, every step
    _generate(case, "cfg2 x ulysses2", monkeypatch, tmp_path)


def _generate(case, mesh, monkeypatch, tmp_path):
    folder, want_latents, want_frames = case
    seen, write = {}, generate_module.write

    def capture(r, result):
        seen["result"] = result
        return write(r, result)

    monkeypatch.setattr(generate_module, "write", capture)
    out = tmp_path / "hy.mp4"
    argv = ["generate", "--weights", str(folder), "--prompt", PROMPT, "--height", str(H), "--width", str(W)]
    argv += ["--num_frames", str(FRAMES), "--steps", str(STEPS), "--seed", str(SEED)]
    assert cli.main([*argv, *MESHES[mesh], "--output", str(out)]) == 0
    result = seen["result"]
    tol.check(result.latents, want_latents, tol.TORCH_LOOP, f"jaxdit generate {mesh}: final latents")
    frames = np.clip((np.asarray(result.images) + 1) / 2, 0, 1)
    assert frames.shape == want_frames.shape == (1, FRAMES, H, W, 3)
    tol.check(frames, want_frames, tol.PIXELS["hunyuanvideo1.5"], f"jaxdit generate {mesh}: frames")
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate)
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert (len(decoded), *decoded[0].shape) == (FRAMES, H, W, 3) and rate == 24
