"""``offload_encoders``: the text encoders' weights wait in host memory between prompts.

The encoders give the same embeddings as when they stay on the device, and once a prompt is encoded no
device holds any of their weights (the transformer gets that memory); ``jaxdit generate
--offload_encoders`` runs end to end and is refused where it would change nothing.
"""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest
import tiny_pipelines

from jaxdit import cli
from jaxdit.generate_checks import check_run
from jaxdit.generate_request import GenerateRequest
from jaxdit.loading.flux import load_flux_text_encoders

PROMPTS = ["a small red cube", "two green spheres on a table"]


def _device_weights(encoders) -> set[int]:
    """ids of the live device arrays that are the encoders' parameters (by buffer identity)."""
    live = {id(a) for a in jax.live_arrays() if not a.is_deleted()}
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(encoders.t5)) + jax.tree.leaves(nnx.state(encoders.clip))
    return {id(x) for x in leaves if id(x) in live and not x.is_deleted()}


def test_offloaded_encoders_give_the_same_embeddings_and_leave_the_device():
    folder = tiny_pipelines.flux_folder()
    resident = load_flux_text_encoders(folder)
    offloaded = load_flux_text_encoders(folder, offload=True)
    assert _device_weights(resident) and not _device_weights(offloaded)
    gc.collect()  # arrays only a reference cycle holds are not live
    before = {id(a) for a in jax.live_arrays()}
    for _ in range(2):  # the second call copies the weights in again and frees them again
        got = offloaded(PROMPTS, max_sequence_length=8)
        gc.collect()
        # Only the results stay (on CPU numpy shares their buffers); nothing of the encoders.
        new = sorted(a.shape for a in jax.live_arrays() if id(a) not in before)
        assert new == sorted(np.shape(x) for x in got)
    want = resident(PROMPTS, max_sequence_length=8)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_generate_with_offloaded_encoders(tmp_path, capsys):
    out = tmp_path / "cube.png"
    argv = ["generate", "--weights", str(tiny_pipelines.flux_folder()), "--prompt", PROMPTS[0]]
    argv += ["--height", "16", "--width", "24", "--steps", "2", "--max_sequence_length", "8"]
    assert cli.main([*argv, "--offload_encoders", "--output", str(out)]) == 0
    assert out.exists() and f"wrote {out}" in capsys.readouterr().out


def test_offload_without_a_pipeline_folder_is_refused():
    with pytest.raises(ValueError, match="--offload_encoders .* would change nothing"):
        check_run(GenerateRequest(prompt="7", offload_encoders=True))
