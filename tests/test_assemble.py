"""Building pipelines from folders: what is checked before the large parts load, and the I2V glue."""

import shutil

import numpy as np
import pytest
import tiny_pipelines
import tolerance as tol
from safetensors.numpy import load_file, save_file

from converters.errors import CheckpointError
from jaxdit.pipelines import wan_image
from jaxdit.pipelines.flux import FluxPipeline


def test_broken_transformer_is_reported_before_the_text_encoders_load(tmp_path, monkeypatch):
    folder = shutil.copytree(tiny_pipelines.flux_folder(), tmp_path / "flux")
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, weights)

    def must_not_load(*args, **kwargs):
        raise AssertionError("the text encoders were read before the transformer was checked")

    monkeypatch.setattr("jaxdit.pipelines.flux.load_flux_text_encoders", must_not_load)
    with pytest.raises(CheckpointError, match=f"missing tensor {dropped!r}"):
        FluxPipeline.from_pretrained(folder)


class _Recorder:
    """Stands in for the CLIP image encoder and the VAE: records what it is given."""

    def __init__(self):
        self.images = None
        self.video = None
        self.config = type("C", (), {"latents_mean": [0.0] * 16, "latents_std": [1.0] * 16})

    def __call__(self, images):
        self.images = np.stack(images)
        return np.zeros((len(images), 5, 8), np.float32)

    def encode(self, video, mesh=None):
        self.video = video
        b, _, t, h, w = video.shape
        latent = np.zeros((b, 16, (t - 1) // 4 + 1, h // 8, w // 8), np.float32)
        return latent, latent


def test_float_and_uint8_pictures_give_both_encoders_the_same_input():
    picture = np.random.default_rng(0).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    seen = {}
    for name, image in (("uint8", picture), ("float", picture / 255.0)):
        recorder = _Recorder()
        embeds, condition = wan_image.ImageCondition(recorder, recorder)(image, 5, 16, 24)
        seen[name] = (recorder.images, recorder.video)
        assert recorder.images.dtype == np.uint8  # CLIP's processor rescales by 1/255 itself
        assert condition.shape == (1, 20, 2, 2, 3)
    np.testing.assert_array_equal(seen["uint8"][0], seen["float"][0])
    np.testing.assert_array_equal(seen["uint8"][1], seen["float"][1])
    want = picture.transpose(2, 0, 1) / 255 * 2 - 1
    tol.check(seen["uint8"][1][0, :, 0], want, tol.ROUNDING, "the VAE's first frame from uint8")
    assert not seen["uint8"][1][:, :, 1:].any()  # frames after the first are zero


def test_pictures_that_are_not_rgb_or_out_of_range_are_named():
    with pytest.raises(ValueError, match=r"RGB picture\(s\)"):
        wan_image.as_uint8_pictures(np.zeros((16, 24)))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        wan_image.as_uint8_pictures(np.full((16, 24, 3), 2.0))
