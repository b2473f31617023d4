"""FLUX.2 [klein]'s whole generation (prompt, reference pictures, the denoising loop, decoding) on the
meshes the other FLUX.2 files leave out, on the tiny distilled folder (``tests/flux2_klein_tiny.py``):
ulysses2 x tensor2 (heads and MLP units split, one reference picture) and data2 x ulysses2 (two prompts,
one per data group, with two reference pictures the same for both rows). The latents are compared with
the same pipeline on one device (``SAME_SEED``); the mesh's VAE decode of the one-device latents with
diffusers' decode of them (``TORCH_FORWARD``). The two prompts give different pictures, so a data split
that mixed rows up fails.
"""

from __future__ import annotations

import flux2_klein_tiny as tiny
import jax
import numpy as np
import pytest
import tolerance as tol
from PIL import Image

from jaxdit.mesh import ParallelConfig
from jaxdit.pipelines.flux2 import Flux2KleinPipeline

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

FAST = {"xla_backend_optimization_level": 0}
CALL = dict(height=32, width=48, num_inference_steps=3, seed=4, max_sequence_length=40, guidance_scale=1.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tiny.pipeline(tmp_path_factory.mktemp("flux2meshes") / "klein")
    rng = np.random.default_rng(13)
    pictures = [Image.fromarray(rng.integers(0, 256, (68, 72, 3), dtype=np.uint8)) for _ in range(2)]
    one = Flux2KleinPipeline.from_pretrained(folder, ParallelConfig().make_mesh(jax.devices()[:1]))
    vae = diffusers.AutoencoderKLFlux2.from_pretrained(folder / "vae").eval()
    return folder, pictures, one, vae


@pytest.mark.parametrize(
    "parallel, prompts, references",
    [
        (ParallelConfig(ulysses=2, tensor=2), ["a photo of a cat on a mat"], 1),
        (ParallelConfig(data=2, ulysses=2), ["a photo of a cat on a mat", "a red car"], 2),
    ],
    ids=["ulysses2-tensor2", "data2-ulysses2"],
)
def test_klein_generation_matches_one_device(setup, parallel, prompts, references):
    folder, pictures, one, vae = setup
    pipe = Flux2KleinPipeline.from_pretrained(
        folder, parallel.make_mesh(jax.devices()[: parallel.num_devices]), compiler_options=FAST
    )
    call = dict(CALL, prompt=prompts, image=pictures[:references], progress=False)
    got, want = pipe(**call), one(**call)
    assert got.images.shape == want.images.shape == (len(prompts), 32, 48, 3)
    tol.check(got.latents, want.latents, tol.SAME_SEED, f"klein {parallel.describe()} latents vs one device")
    # The mesh's VAE decode of the one-device latents against diffusers' decode of them (the decode on the
    # mesh differs from the one-device decode by 2.8e-6 to 3.0e-6 here, as much as the one-device decode
    # differs from diffusers: the tiny random decoder's fp32 rounding, above VAE_TILES' 2.5e-6).
    decoded = pipe.decode(want.latents)
    with torch.no_grad():
        ref = vae.decode(torch.from_numpy(np.asarray(want.latents, np.float32))).sample.numpy()
    ref = np.clip(ref.transpose(0, 2, 3, 1), -1.0, 1.0)
    tol.check(decoded, ref, tol.TORCH_FORWARD, f"klein {parallel.describe()} VAE decode vs diffusers")
    if len(prompts) == 2:
        apart = np.abs(want.latents[0] - want.latents[1]).max() / np.abs(want.latents).max()
        assert apart > 1e-2, apart  # the rows differ: a mixed-up split would show
