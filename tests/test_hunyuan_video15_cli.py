"""HunyuanVideo 1.5 through ``jaxdit generate``: the tiny ``HunyuanVideo15Pipeline`` folder saved by
diffusers with its text encoders (``hunyuan_video15_folder.py``) from a prompt with quoted text to an MP4 on
cfg2 x ulysses2 (4 emulated devices), against diffusers running the reloaded folder with the project's
noise (numpy ``default_rng(seed).standard_normal`` of [1, 4, F', H/16, W/16]); the CFG scale is the
folder guider's, as diffusers reads it."""

from __future__ import annotations

import av
import hunyuan_video15_folder as hf
import numpy as np
import tolerance as tol
import torch

from jaxdit import cli
from jaxdit import generate as generate_module
from jaxdit.pipelines import latents as latent_ops

PROMPT = 'a cat walks on grass, sign reading "hello"'
H, W, FRAMES, STEPS, SEED = 32, 48, 5, 3, 5


def test_cli_prompt_to_mp4_matches_diffusers(monkeypatch, tmp_path):
    import diffusers

    folder = tmp_path / "HunyuanVideo-1.5-tiny"
    hf.save(folder, with_text=True)
    pipe = diffusers.HunyuanVideo15Pipeline.from_pretrained(folder)
    noise = torch.from_numpy(latent_ops.initial_noise(SEED, (1, 4, (FRAMES - 1) // 4 + 1, H // 16, W // 16)))
    call = dict(height=H, width=W, num_frames=FRAMES, num_inference_steps=STEPS, latents=noise)
    with torch.no_grad():
        want_latents = pipe(PROMPT, output_type="latent", **call).frames.numpy()
        want_frames = pipe(PROMPT, output_type="np", **call).frames

    seen, write = {}, generate_module.write

    def capture(r, result):
        seen["result"] = result
        return write(r, result)

    monkeypatch.setattr(generate_module, "write", capture)
    out = tmp_path / "hy.mp4"
    argv = ["generate", "--weights", str(folder), "--prompt", PROMPT, "--height", str(H), "--width", str(W)]
    argv += ["--num_frames", str(FRAMES), "--steps", str(STEPS), "--seed", str(SEED)]
    assert cli.main([*argv, "--use_cfg_parallel", "--ulysses_degree", "2", "--output", str(out)]) == 0
    result = seen["result"]
    tol.check(result.latents, want_latents, tol.TORCH_LOOP, "jaxdit generate cfg2 x ulysses2: final latents")
    frames = np.clip((np.asarray(result.images) + 1) / 2, 0, 1)
    assert frames.shape == want_frames.shape == (1, FRAMES, H, W, 3)
    tol.check(frames, want_frames, tol.PIXELS["hunyuanvideo1.5"], "jaxdit generate cfg2 x ulysses2: frames")
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate)
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert (len(decoded), *decoded[0].shape) == (FRAMES, H, W, 3) and rate == 24
