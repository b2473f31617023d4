"""Qwen-Image's transformer against diffusers' ``QwenImageTransformer2DModel``, on one device and on
meshes, with prompts of different lengths under a text key mask.

A tiny random diffusers model (``qwen_image_tiny.py``) saved with ``save_pretrained`` in shards and
loaded through ``converters/qwen_image.py``; 5 text tokens (odd: padded on every sequence mesh) and a
4 x 6 packed image. fp32 unless said; bounds from tests/tolerance.py, errors printed (``pytest -s``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwen_image_tiny as tiny
import tolerance as tol
import torch

from converters.errors import CheckpointError
from converters.qwen_image import CHECKPOINTS, detect
from converters.safetensors_io import write_safetensors
from jaxdit.loading.params import load_params
from jaxdit.mesh import ParallelConfig, single_device_mesh
from jaxdit.models import qwen_image
from jaxdit.models.qwen_image_config import QwenImageConfig, rope_positions

ROWS, COLS, TEXT = 4, 6, 5
LENGTHS = [5, 3, 1, 4]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(folder, torch model, inputs, diffusers' output)."""
    folder = tmp_path_factory.mktemp("qwen_image") / "transformer"
    model = tiny.transformer()
    model.save_pretrained(folder, max_shard_size="40KB")
    x = tiny.inputs(len(LENGTHS), TEXT, ROWS, COLS, LENGTHS)
    return folder, model, x, tiny.reference(model, x, ROWS, COLS)


def _forward(folder, pc: ParallelConfig, x, dtype=None):
    mesh = pc.make_mesh(jax.devices()[: pc.num_devices])
    model = load_params(folder, mesh, dtype, checkpoints=CHECKPOINTS)
    txt_ids, img_ids = rope_positions(TEXT, ROWS, COLS)
    return np.asarray(qwen_image.sharded(model, mesh)(**x, txt_ids=txt_ids, img_ids=img_ids), np.float32)


@pytest.fixture(scope="module")
def one_device(case):
    folder, _, x, _ = case
    return _forward(folder, ParallelConfig(), x)


def test_matches_diffusers_with_a_text_mask(case, one_device):
    _, _, _, want = case
    assert one_device.shape == want.shape == (len(LENGTHS), ROWS * COLS, 16)
    tol.check(one_device, want, tol.TORCH_FORWARD, "Qwen-Image transformer vs diffusers")


@pytest.mark.parametrize(
    "pc",
    [ParallelConfig(ring=2, ulysses=2), ParallelConfig(ulysses=2, tensor=2), ParallelConfig(cfg=2, ring=2)],
    ids=lambda pc: pc.describe(),
)
def test_meshes_match_one_device(case, one_device, pc):
    folder, _, x, want = case
    got = _forward(folder, pc, x)
    tol.check(got, one_device, tol.SHARDED, f"{pc.describe()} vs one device")


def test_bf16_against_fp32(case):
    folder, _, x, want = case
    got = _forward(folder, ParallelConfig(), x, jnp.bfloat16)
    tol.check(got, want, tol.BF16, "bf16 vs fp32 diffusers")


def test_rope_positions_are_diffusers(case):
    """Our (frame, row, column) ids through jaxdit's angles give diffusers' ``QwenEmbedRope`` frequencies."""
    from jaxdit.models.layers import rope_angles

    _, model, _, _ = case
    for rows, cols, text in ((ROWS, COLS, TEXT), (5, 3, 7)):
        img_f, txt_f = model.pos_embed([(1, rows, cols)], max_txt_seq_len=text, device=torch.device("cpu"))
        txt_ids, img_ids = rope_positions(text, rows, cols)
        for ids, want in ((img_ids, img_f), (txt_ids, txt_f)):
            angles = np.asarray(rope_angles(jnp.asarray(ids), tiny.CONFIG["axes_dims_rope"], 10000.0))
            np.testing.assert_allclose(np.cos(angles), want.real.numpy(), atol=2e-6)
            np.testing.assert_allclose(np.sin(angles), want.imag.numpy(), atol=2e-6)


def test_comfyui_single_file_reads_like_the_folder(case, tmp_path):
    folder, model, _, _ = case
    sd = {f"model.diffusion_model.{k}": v.numpy() for k, v in model.state_dict().items()}
    path = write_safetensors(tmp_path / "qwen_image_comfy.safetensors", sd)
    with pytest.raises(CheckpointError, match="head_dim 16: pass the config"):
        detect(path)  # the RoPE split of a head_dim other than Qwen-Image's 128 is not in the weights
    opened = detect(path, QwenImageConfig(**tiny.CONFIG))
    assert opened.prefix == "model.diffusion_model." and opened.config == detect(folder).config
    mesh = single_device_mesh()
    a = load_params(path, mesh, checkpoints=CHECKPOINTS, config=QwenImageConfig(**tiny.CONFIG))
    b = load_params(folder, mesh, checkpoints=CHECKPOINTS)
    for (pa, va), (pb, vb) in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b), strict=True
    ):
        assert pa == pb and np.array_equal(np.asarray(va), np.asarray(vb)), pa


def test_full_size_config_from_shapes():
    """A ComfyUI file of the full-size model: its config inferred from the tensors' shapes alone."""
    from converters.qwen_image import config_from_shapes, diffusers_table

    cfg = QwenImageConfig.preset("qwen-image")
    table, shapes = diffusers_table(cfg), qwen_image.parameter_shapes(cfg)
    sources = {}
    for rule in table.rules:
        shape = shapes[rule.target][1:] if rule.stack else shapes[rule.target]
        shape = shape[::-1] if rule.target.endswith("kernel") else shape
        for keys in table.source_sets(rule):
            sources[keys[0]] = shape
    assert config_from_shapes(sources) == cfg


def test_bad_checkpoints_are_refused(case, tmp_path):
    _, model, _, _ = case
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    extra = write_safetensors(
        tmp_path / "extra.safetensors", {**sd, "transformer_blocks.0.attn.extra": sd["txt_norm.weight"]}
    )
    with pytest.raises(CheckpointError, match=r"attn\.extra.*not used"):
        load_params(
            extra, single_device_mesh(), checkpoints=CHECKPOINTS, config=QwenImageConfig(**tiny.CONFIG)
        )
    with pytest.raises(ValueError, match="use_layer3d_rope: that Qwen-Image variant is not supported"):
        QwenImageConfig.from_diffusers(
            {"_class_name": "QwenImageTransformer2DModel", "use_layer3d_rope": True}
        )


def test_jaxdit_convert_to_orbax_loads_the_same_model(case, tmp_path):
    """``jaxdit convert`` of the diffusers folder -> an orbax folder recorded as Qwen-Image, which
    ``jaxdit.load_transformer`` reads back (on a mesh) into the same forward, bit for bit."""
    from jaxdit import families
    from jaxdit.cli import main

    folder, _, x, _ = case
    assert main(["convert", str(folder), str(tmp_path / "orbax")]) == 0
    assert families.detect_family(tmp_path / "orbax").name == "qwen-image"
    txt_ids, img_ids = rope_positions(TEXT, ROWS, COLS)
    run = lambda path: np.asarray(
        families.load_transformer(path, ParallelConfig(ulysses=2))(**x, txt_ids=txt_ids, img_ids=img_ids)
    )
    np.testing.assert_array_equal(run(tmp_path / "orbax"), run(folder))
