"""Writing pictures and videos: formats, round trips, and atomicity (a failed write leaves nothing)."""

import os

import numpy as np
import pytest
from PIL import Image

from jaxdit.pipelines import output


def _frames(n=9, h=33, w=47):
    # Flat grey levels per frame (easy for a lossy codec) plus a gradient so frames are not trivial.
    ramp = np.linspace(0, 40, w, dtype=np.float32)[None, :, None]
    return [np.clip(i * 20 + ramp + np.zeros((h, w, 3)), 0, 255).astype(np.uint8) for i in range(n)]


def test_to_uint8_maps_the_unit_range_and_clips():
    x = np.array([-2.0, -1.0, 0.0, 1.0, 3.0])
    np.testing.assert_array_equal(output.to_uint8(x), [0, 0, 128, 255, 255])


def test_png_round_trip_and_normal_file_mode(tmp_path):
    image = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    path = output.save_image(tmp_path / "a.png", image)
    np.testing.assert_array_equal(np.asarray(Image.open(path)), image)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask


def test_mp4_round_trip_keeps_frame_count_and_content(tmp_path):
    av = pytest.importorskip("av")
    frames = _frames()
    path = output.save_video(tmp_path / "v.mp4", frames, fps=8)
    with av.open(str(path)) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(decoded) == len(frames)
    # Odd sides are padded by one edge row/column (yuv420p needs even sides), never resized.
    assert decoded[0].shape == (34, 48, 3)
    errors = [
        np.abs(d[:33, :47].astype(int) - f.astype(int)).mean() for d, f in zip(decoded, frames, strict=True)
    ]
    assert max(errors) < 2.0, errors  # crf 18 on smooth frames: mean error of about a grey level


def test_gif_round_trip(tmp_path):
    frames = _frames(n=3, h=6, w=8)
    path = output.save_video(tmp_path / "v.gif", frames)
    gif = Image.open(path)
    assert gif.n_frames == 3


def test_unknown_video_suffix_is_rejected_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r"\.mp4 or \.gif"):
        output.save_video(tmp_path / "v.avi", _frames(n=2))
    assert list(tmp_path.iterdir()) == []


def test_mismatched_frames_are_rejected_naming_the_frame(tmp_path):
    bad = [np.zeros((4, 4, 3), np.uint8), np.zeros((6, 6, 3), np.uint8)]
    with pytest.raises(ValueError, match="frame 1 is uint8 \\(6, 6, 3\\)"):
        output.save_video(tmp_path / "v.mp4", bad)
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_no_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    pytest.importorskip("av")
    path = tmp_path / "v.mp4"
    path.write_bytes(b"previous result")

    def encoder_dies(av, tmp, frames, fps):
        with open(tmp, "wb") as f:
            f.write(b"half a video")
        raise RuntimeError("encoder died")

    monkeypatch.setattr(output, "_write_mp4", encoder_dies)
    with pytest.raises(RuntimeError, match="encoder died"):
        output.save_video(path, _frames(n=2))
    assert path.read_bytes() == b"previous result"
    assert [p.name for p in tmp_path.iterdir()] == ["v.mp4"]


def test_save_array_writes_the_named_file_whatever_its_suffix(tmp_path):
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = output.save_array(tmp_path / "latents.bin", array)
    np.testing.assert_array_equal(np.load(path), array)
    assert [p.name for p in tmp_path.iterdir()] == ["latents.bin"]  # no stray temp or .npy twin
