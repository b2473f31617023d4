"""HunyuanVideo 1.5 text-to-video against diffusers' ``HunyuanVideo15Pipeline`` from the same saved folder.

A tiny random folder (``hunyuan_video15_folder.py``: transformer, VAE, scheduler with shift 5, guider with
scale 6; no text encoders, so both pipelines take embeddings), one prompt (diffusers' VAE attention
broadcasts its mask wrongly for a batch of two), 3 steps of CFG with a glyph prompt in the conditional
branch only, 5 frames of 32 x 48 (2 x 2 x 3 latent tokens), the noise given to both. jaxdit runs on one
device and on ring2 x ulysses2 (from embeddings) and cfg2 x ulysses2 (from the prompt). diffusers clamps
its frames to [0, 1]; ours are in [-1, 1], compared after the same mapping. fp32; bounds from
tests/tolerance.py.
"""

from __future__ import annotations

import hunyuan_video15_folder as hf
import numpy as np
import pytest
import tolerance as tol
import torch

from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines.hunyuan_video15 import HunyuanVideo15Pipeline, default_size, read_guider

CALL = dict(height=32, width=48, num_frames=5, num_inference_steps=3)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, embeddings, noise, diffusers' final latents, diffusers' frames in [0, 1])."""
    folder = tmp_path_factory.mktemp("hunyuan_video15_pipeline") / "folder"
    pipe = hf.save(folder)
    emb = {**hf.embeddings([6], [2]), **hf.embeddings([3], [0], seed=1, prefix="negative_")}
    noise = np.random.default_rng(0).standard_normal((1, 4, 2, 2, 3), dtype=np.float32)
    args = {k: torch.from_numpy(v) for k, v in emb.items()}
    with torch.no_grad():
        latents = pipe(**args, latents=torch.from_numpy(noise), output_type="latent", **CALL).frames.numpy()
        frames = pipe(**args, latents=torch.from_numpy(noise), output_type="np", **CALL).frames
    return folder, emb, noise, latents, frames


@pytest.mark.parametrize(
    "pc",
    [ParallelConfig(), ParallelConfig(ring=2, ulysses=2)],  # cfg2 x ulysses2: the prompt test below
    ids=lambda pc: pc.describe(),
)
def test_text_to_video_matches_diffusers(case, pc):
    folder, emb, noise, want_latents, want_frames = case
    pipe = HunyuanVideo15Pipeline.from_pretrained(folder, pc)
    out = pipe(**emb, latents=noise, output_type="np", progress=False, **CALL)
    tol.check(out.latents, want_latents, tol.TORCH_LOOP, f"{pc.describe()} final latents vs diffusers")
    frames = np.clip((np.asarray(out.images) + 1) / 2, 0, 1)
    tol.check(frames, want_frames, tol.PIXELS["hunyuanvideo1.5"], f"{pc.describe()} frames vs diffusers")


def test_data2_ulysses2_splits_two_prompts_and_matches_diffusers(case):
    """Data parallelism: two prompts (6 and 4 prompt tokens, 2 and 0 glyph tokens) each on its own half
    of data2 x ulysses2, both CFG branches on it, vs diffusers' batch of two (latents only: its VAE
    attention mishandles a batch of two, see the module docstring)."""
    folder = case[0]
    emb = {
        **hf.embeddings([6, 4], [2, 0], seed=2),
        **hf.embeddings([3, 5], [0, 1], seed=3, prefix="negative_"),
    }
    noise = np.random.default_rng(1).standard_normal((2, 4, 2, 2, 3), dtype=np.float32)
    import diffusers

    no_text = dict(text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None)
    ref = diffusers.HunyuanVideo15Pipeline.from_pretrained(folder, **no_text)  # embeddings given
    args = {k: torch.from_numpy(v) for k, v in emb.items()}
    with torch.no_grad():
        want = ref(**args, latents=torch.from_numpy(noise), output_type="latent", **CALL).frames.numpy()
    pc = ParallelConfig(data=2, ulysses=2)
    pipe = HunyuanVideo15Pipeline.from_pretrained(folder, pc)
    out = pipe(**emb, latents=noise, output_type="latent", progress=False, **CALL)
    tol.check(out.latents, want, tol.TORCH_LOOP, "data2 x ulysses2, two prompts: final latents vs diffusers")
    # the two prompts must give different videos, or the split could not be seen
    assert np.abs(want[0] - want[1]).max() > 100 * tol.TORCH_LOOP.allowed(np.abs(want).max())


def test_defaults_and_refusals(case, tmp_path):
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    folder, emb, noise, _, _ = case
    for target in (640, 960):  # 480p and 720p
        want = HunyuanVideo15ImageProcessor(vae_scale_factor=16).calculate_default_height_width(9, 16, target)
        assert default_size(target) == tuple(want)
    assert read_guider(folder) == hf.GUIDANCE
    pipe = HunyuanVideo15Pipeline.from_pretrained(folder)
    with pytest.raises(ValueError, match="this pipeline has no text encoders"):
        pipe(prompt="a cat", **CALL)
    with pytest.raises(ValueError, match="pass negative_prompt_embeds, negative_prompt_embeds_mask"):
        pipe(**{k: v for k, v in emb.items() if not k.startswith("negative_")}, **CALL)
    with pytest.raises(ValueError, match="1 \\+ k \\* 4 frames"):
        pipe(**emb, **{**CALL, "num_frames": 6})


PROMPT = 'a cat walks on grass, sign reading "hello"'


@pytest.fixture(scope="module")
def text_case(tmp_path_factory):
    """A folder with the text encoders (word-level Qwen tokenizer whose template prefix is 108 tokens,
    ByT5's byte tokenizer) and diffusers' run from the prompt (the empty negative prompt by default)."""
    import diffusers

    folder = tmp_path_factory.mktemp("hunyuan_video15_text") / "folder"
    hf.save(folder, with_text=True)
    pipe = diffusers.HunyuanVideo15Pipeline.from_pretrained(folder)
    noise = np.random.default_rng(0).standard_normal((1, 4, 2, 2, 3), dtype=np.float32)
    with torch.no_grad():
        embeds = [x.numpy() for x in pipe.encode_prompt(PROMPT, device="cpu", dtype=torch.float32)]
        latents = pipe(PROMPT, latents=torch.from_numpy(noise), output_type="latent", **CALL).frames.numpy()
    return folder, noise, embeds, latents


def test_prompt_to_latents_matches_diffusers(text_case):
    """Both encoders (Qwen2.5-VL's hidden_states[-3] after the 108-token prefix, ByT5 of the quoted
    text), then CFG against the empty prompt's encoding, on cfg2 x ulysses2."""
    folder, noise, want_embeds, want_latents = text_case
    pipe = HunyuanVideo15Pipeline.from_pretrained(folder, ParallelConfig(cfg=2, ulysses=2))
    embeds, mask, glyph, glyph_mask = pipe.encode([PROMPT])
    np.testing.assert_array_equal(mask, want_embeds[1])
    np.testing.assert_array_equal(glyph_mask, want_embeds[3])
    assert 0 < mask.sum() < mask.size and 0 < glyph_mask.sum() < glyph_mask.size
    tol.check(embeds, want_embeds[0], tol.TORCH_FORWARD, "Qwen2.5-VL prompt features vs diffusers")
    tol.check(glyph, want_embeds[2], tol.TORCH_FORWARD, "ByT5 glyph features vs diffusers")
    out = pipe(PROMPT, latents=noise, output_type="latent", progress=False, **CALL)
    tol.check(out.latents, want_latents, tol.TORCH_LOOP, "prompt -> latents on cfg2 x ulysses2 vs diffusers")
