"""FLUX.2 transformer checkpoints as Black Forest Labs publishes them: one safetensors file in BFL's key
names (``flux2-dev.safetensors``; klein's files use the same names without ``guidance_in``).

A tiny random diffusers ``Flux2Transformer2DModel`` (dev: a guidance embedding; klein: none) with head_dim
128 and FLUX.2's RoPE split (32, 32, 32, 32), so its config is inferable from the file's shapes as the
released ones are, is written in BFL's layout by :func:`to_bfl`, this test's own inverse of diffusers'
naming (written from the module tree, not from jaxdit's table). diffusers' single-file converter
(``convert_flux2_transformer_checkpoint_to_diffusers``) reads that file back to the model's state dict
exactly, so the file is BFL's layout as diffusers understands it. Then, through jaxdit:

- the parameters read from the BFL file equal those read from the diffusers folder, exactly, and the
  config inferred from the shapes is the folder's;
- the forward on ulysses2 matches diffusers' (two reference images);
- ``jaxdit generate --model flux2-dev --weights FILE --prompt_embeds`` (the preset registered as the tiny
  config) runs dev's pipeline on ulysses2 and gives the one-device pipeline's latents; a klein file runs
  klein's; ``--use_cfg_parallel`` with a dev file is refused in one line;
- ``jaxdit convert`` of the BFL file gives an orbax folder that loads to the same forward, bit for bit.
"""

from __future__ import annotations

import flux2_tiny as tiny
import jax
import numpy as np
import pytest
import tolerance as tol
import torch

import jaxdit
from converters import flux2 as flux2_converters
from converters.safetensors_io import write_safetensors
from jaxdit.cli import main
from jaxdit.mesh import ParallelConfig
from jaxdit.models import flux2
from jaxdit.models.flux2_config import Flux2Config
from jaxdit.pipelines.flux2 import Flux2KleinPipeline
from jaxdit.pipelines.flux2_dev import Flux2Pipeline

pytest.importorskip("diffusers")

#: head_dim 128 and FLUX.2's RoPE split: the config of a BFL file is inferred from its shapes.
SHAPE = dict(num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=2,
             mlp_ratio=1.5, axes_dims_rope=(32, 32, 32, 32))  # fmt: skip
KINDS = {"dev": dict(guidance_embeds=True), "klein": dict(guidance_embeds=False)}
TEXT, ROWS, COLS = 5, 4, 3

#: diffusers module -> BFL module, outside the blocks.
TOP = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
}
#: Within a double block: diffusers module -> BFL (module, parameter name).
DOUBLE = {
    "attn.norm_q": ("img_attn.norm.query_norm", "scale"),
    "attn.norm_k": ("img_attn.norm.key_norm", "scale"),
    "attn.to_out.0": ("img_attn.proj", "weight"),
    "ff.linear_in": ("img_mlp.0", "weight"),
    "ff.linear_out": ("img_mlp.2", "weight"),
    "attn.norm_added_q": ("txt_attn.norm.query_norm", "scale"),
    "attn.norm_added_k": ("txt_attn.norm.key_norm", "scale"),
    "attn.to_add_out": ("txt_attn.proj", "weight"),
    "ff_context.linear_in": ("txt_mlp.0", "weight"),
    "ff_context.linear_out": ("txt_mlp.2", "weight"),
}
#: The double blocks' fused q, k, v rows (BFL's ``qkv``), per stream.
FUSED_QKV = {"img_attn": ("attn.to_q", "attn.to_k", "attn.to_v"),
             "txt_attn": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}  # fmt: skip
SINGLE = {
    "attn.to_qkv_mlp_proj": ("linear1", "weight"),
    "attn.to_out": ("linear2", "weight"),
    "attn.norm_q": ("norm.query_norm", "scale"),
    "attn.norm_k": ("norm.key_norm", "scale"),
}


def to_bfl(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A diffusers FLUX.2 state dict in BFL's names; every key used once."""
    left, out = dict(sd), {}
    for src, dst in TOP.items():
        if f"{src}.weight" in left:
            out[f"{dst}.weight"] = left.pop(f"{src}.weight")
    # AdaLayerNormContinuous's rows are (scale, shift) in diffusers, (shift, scale) in BFL.
    scale, shift = np.split(left.pop("norm_out.linear.weight"), 2, axis=0)
    out["final_layer.adaLN_modulation.1.weight"] = np.concatenate([shift, scale], axis=0)
    blocks = lambda prefix: sorted({int(k.split(".")[1]) for k in sd if k.startswith(prefix + ".")})  # noqa: E731
    for i in blocks("transformer_blocks"):
        d = f"transformer_blocks.{i}"
        for stream, names in FUSED_QKV.items():
            rows = [left.pop(f"{d}.{n}.weight") for n in names]
            out[f"double_blocks.{i}.{stream}.qkv.weight"] = np.concatenate(rows, axis=0)
        for src, (dst, param) in DOUBLE.items():
            out[f"double_blocks.{i}.{dst}.{param}"] = left.pop(f"{d}.{src}.weight")
    for i in blocks("single_transformer_blocks"):
        for src, (dst, param) in SINGLE.items():
            out[f"single_blocks.{i}.{dst}.{param}"] = left.pop(f"single_transformer_blocks.{i}.{src}.weight")
    assert not left, sorted(left)
    return out


@pytest.fixture(scope="module", params=list(KINDS))
def checkpoint(request, tmp_path_factory):
    """(kind, the torch model, its diffusers folder, the BFL file)."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    kind = request.param
    root = tmp_path_factory.mktemp(f"flux2bfl-{kind}")
    model = tiny.transformer(seed=21, **SHAPE, **KINDS[kind])
    model.save_pretrained(root / "transformer")
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    bfl = to_bfl(sd)
    assert ("guidance_in.in_layer.weight" in bfl) is (kind == "dev")
    back = convert_flux2_transformer_checkpoint_to_diffusers({k: torch.from_numpy(v) for k, v in bfl.items()})
    assert sorted(back) == sorted(sd)
    for key, value in sd.items():
        np.testing.assert_array_equal(back[key].numpy(), value, err_msg=key)
    path = write_safetensors(root / f"flux2-{kind}.safetensors", bfl)
    return kind, model, root / "transformer", path


def test_bfl_file_parameters_are_the_diffusers_folders(checkpoint):
    kind, _, folder, path = checkpoint
    bfl, diffusers = flux2_converters.detect(path), flux2_converters.detect(folder)
    assert bfl.layout == "bfl" and bfl.prefix == ""
    assert bfl.config == diffusers.config == Flux2Config.from_diffusers(folder / "config.json")
    shapes = flux2.parameter_shapes(bfl.config)
    got, want = bfl.resolve(shapes), diffusers.resolve(shapes)
    assert sorted(got) == sorted(want) == sorted(shapes)
    for name in shapes:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


def test_bfl_file_forward_matches_diffusers_and_converts(checkpoint, tmp_path):
    kind, model, _, path = checkpoint
    x = tiny.inputs(1, TEXT, (ROWS, COLS), ((2, 2), (1, 3)), guidance=kind == "dev", seed=4)
    forward = jaxdit.load_transformer(path, ParallelConfig(ulysses=2))
    got = np.asarray(forward(**x))
    tol.check(
        got, tiny.reference(model, x), tol.TORCH_FORWARD, f"FLUX.2 {kind} BFL file, ulysses2, vs diffusers"
    )
    assert main(["convert", str(path), str(tmp_path / "orbax")]) == 0
    again = jaxdit.load_transformer(tmp_path / "orbax", ParallelConfig(ulysses=2))
    assert np.array_equal(np.asarray(again(**x)), got)


def _argv(path, embeds, out, guidance, *more):
    return ["generate", "--weights", str(path), "--prompt_embeds", str(embeds),
            "--height", str(16 * ROWS), "--width", str(16 * COLS), "--steps", "2", "--seed", "5",
            "--guidance_scale", str(guidance), "--output", str(out), *more]  # fmt: skip


def test_cli_runs_a_bfl_file(checkpoint, tmp_path, monkeypatch, capsys):
    """dev: ``--model flux2-dev`` (registered as the tiny config) runs dev's pipeline, one branch with the
    guidance input; klein (no ``--model``: the headers say) runs klein's at scale 1. Each gives the
    one-device pipeline's latents from the diffusers folder; dev refuses ``--use_cfg_parallel`` first."""
    kind, _, folder, path = checkpoint
    config = Flux2Config.from_diffusers(folder / "config.json")
    monkeypatch.setitem(Flux2Config.PRESETS, "flux2-dev", config.to_json())
    text = np.random.default_rng(6).standard_normal((1, TEXT, tiny.CONFIG["joint_attention_dim"]))
    text = text.astype(np.float32)
    np.savez(tmp_path / "e.npz", prompt_embeds=text)
    out = tmp_path / "latents.npy"
    guidance, pipeline = (3.5, Flux2Pipeline) if kind == "dev" else (1.0, Flux2KleinPipeline)
    model = ["--model", "flux2-dev"] if kind == "dev" else []
    if kind == "dev":
        assert main(_argv(path, tmp_path / "e.npz", out, guidance, "--use_cfg_parallel", *model)) == 2
        assert "--use_cfg_parallel: FLUX.2 [dev] is guidance-distilled" in capsys.readouterr().err
    code = main(_argv(path, tmp_path / "e.npz", out, guidance, "--ulysses_degree", "2", *model))
    assert code == 0, capsys.readouterr().err
    one = pipeline.from_checkpoint(folder, ParallelConfig().make_mesh(jax.devices()[:1]))
    want = one(prompt_embeds=text, height=16 * ROWS, width=16 * COLS, num_inference_steps=2, seed=5,
               guidance_scale=guidance, output_type="latent", progress=False).latents  # fmt: skip
    tol.check(
        np.load(out), want, tol.SAME_SEED, f"jaxdit generate of a BFL {kind} file, ulysses2, vs one device"
    )
