"""FLUX.2 LoRAs in the layouts people share, fused by jaxdit on a tensor2 x ulysses2 mesh, against
diffusers' ``Flux2Transformer2DModel`` with the file read by its own loader
(``Flux2KleinPipeline.lora_state_dict``: its converters of the BFL and kohya layouts) and loaded with
``load_lora_adapter``; the tiny klein transformer of ``flux2_tiny.py`` with two reference images.

One PEFT adapter (random factors, rank 4, alpha 8: scale 2) on every Linear of the model is written by
diffusers' ``save_lora_adapter`` (the diffusers layout). The same factors are rewritten by hand as
ai-toolkit's / ComfyUI's BFL module tree under ``diffusion_model.`` (the three q, k, v adapters of a
double block's stream stacked into one of rank 12 on the fused ``qkv`` with a block-diagonal up matrix,
which is the same update; no alpha, so alpha / rank is folded into ``up``, as diffusers' BFL converter
reads none) and as kohya's ``lora_unet_`` keys with alphas. Each file moves the output by far more than
the bound, so a wrong mapping cannot pass.

What diffusers 0.42.1 does not read the same way is left out of its files and checked on jaxdit's side:
its BFL converter maps ``final_layer.adaLN_modulation.1`` onto ``norm_out.linear`` without the (shift,
scale) -> (scale, shift) swap its checkpoint converter makes, and its kohya converter drops the
modulation layers (a warning). jaxdit's BFL final-layer update equals the diffusers-layout one.
"""

from __future__ import annotations

import copy

import flux2_tiny as tiny
import lora_tiny
import numpy as np
import pytest
import tolerance as tol

from converters.lora import read_lora
from converters.safetensors_io import SafetensorsFile, write_safetensors
from jaxdit import load_transformer
from jaxdit.lora import fuse_loras, unfuse_loras
from jaxdit.mesh import ParallelConfig
from jaxdit.models.flux2_config import Flux2Config

pytest.importorskip("diffusers")

SCALE = 0.8
RANK, ALPHA = 4, 8.0
#: Every Linear of the tiny model.
TARGETS = (
    r".*(x_embedder|context_embedder|proj_out|norm_out\.linear|timestep_embedder\.linear_[12]"
    r"|(double_stream_modulation_(img|txt)|single_stream_modulation)\.linear"
    r"|transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)|ff(_context)?\.linear_(in|out))"
    r"|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out))"
)
#: diffusers module (in a block) -> BFL module.
DOUBLE = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
}
FUSED_QKV = {
    "img_attn.qkv": ("to_q", "to_k", "to_v"),
    "txt_attn.qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
}
SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
OUTSIDE = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2-lora")
    base = tiny.transformer(seed=5, guidance_embeds=False)
    base.save_pretrained(root / "transformer")
    path = lora_tiny.write_peft(base, root / "peft.safetensors", TARGETS, rank=RANK, alpha=ALPHA)
    x = tiny.inputs(2, 5, (4, 6), ((2, 3), (3, 1)), guidance=False)
    fwd = load_transformer(root / "transformer", ParallelConfig(tensor=2, ulysses=2))
    fwd.model_config = Flux2Config.from_diffusers(root / "transformer" / "config.json")
    return root, path, fwd, x, base, tiny.reference(base, x)


def _tensors(path) -> dict[str, np.ndarray]:
    with SafetensorsFile(path) as f:
        return {k: f.read(k) for k in f}


def _factors(path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """diffusers module -> (down, up x alpha / rank) of the PEFT file."""
    t = _tensors(path)
    mods = sorted({k[: -len(".lora_A.weight")] for k in t if k.endswith(".lora_A.weight")})
    return {m: (t[m + ".lora_A.weight"], t[m + ".lora_B.weight"] * (ALPHA / RANK)) for m in mods}


def _bfl_modules(factors) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The same updates on BFL's module tree (scale folded into up), the final modulation included."""
    out = {}
    for m, (down, up) in factors.items():
        block = m.split(".", 2)
        if m.startswith("transformer_blocks.") and block[2] in DOUBLE:
            out[f"double_blocks.{block[1]}.{DOUBLE[block[2]]}"] = (down, up)
        elif m.startswith("single_transformer_blocks."):
            out[f"single_blocks.{block[1]}.{SINGLE[block[2]]}"] = (down, up)
        elif m in OUTSIDE:
            out[OUTSIDE[m]] = (down, up)
        elif m == "norm_out.linear":  # BFL's (shift, scale) rows; diffusers' (scale, shift)
            out["final_layer.adaLN_modulation.1"] = (down, np.concatenate(np.split(up, 2)[::-1]))
    for i in {m.split(".")[1] for m in factors if m.startswith("transformer_blocks.")}:
        for fused, parts in FUSED_QKV.items():
            pairs = [factors[f"transformer_blocks.{i}.attn.{p}"] for p in parts]
            up = np.zeros((sum(u.shape[0] for _, u in pairs), 3 * RANK), np.float32)
            for k, (_, u) in enumerate(pairs):
                up[k * u.shape[0] : (k + 1) * u.shape[0], k * RANK : (k + 1) * RANK] = u
            out[f"double_blocks.{i}.{fused}"] = (np.concatenate([d for d, _ in pairs]), up)
    return out


def _diffusers(base, path, x) -> np.ndarray:
    from diffusers import Flux2KleinPipeline

    sd, meta = Flux2KleinPipeline.lora_state_dict(str(path), return_lora_metadata=True)
    prefix = "transformer" if any(k.startswith("transformer.") for k in sd) else None
    model = copy.deepcopy(base)
    model.load_lora_adapter(sd, prefix=prefix, metadata=meta, adapter_name="f")
    model.set_adapters(["f"], weights=[SCALE])
    return tiny.reference(model, x)


def _check(case, path, layout: str):
    _, _, fwd, x, model, base = case
    want = _diffusers(model, path, x)
    assert read_lora(path, fwd.model_config).layout == layout
    fused = fuse_loras(fwd.state, fwd.model_config, [(path, SCALE)])
    try:
        got = np.asarray(fwd(**x), np.float32)
    finally:
        unfuse_loras(fwd.state, fused)
    effect = float(np.abs(want - base).max())
    print(f"FLUX.2 {layout}: the LoRA moves the output by {effect:.3f}; {tol.max_error(got, want):.2e} off")
    assert effect > 100 * tol.TORCH_FORWARD.allowed(np.abs(want).max())
    tol.check(got, want, tol.TORCH_FORWARD, f"FLUX.2 LoRA ({layout}) vs diffusers")


def test_diffusers_peft(case):
    _check(case, case[1], "diffusers")


def test_bfl_ai_toolkit(case):
    root, path, *_ = case
    out = {}
    for m, (down, up) in _bfl_modules(_factors(path)).items():
        if m.startswith("final_layer.adaLN"):
            continue  # diffusers reads it unswapped (module docstring)
        out[f"diffusion_model.{m}.lora_A.weight"], out[f"diffusion_model.{m}.lora_B.weight"] = down, up
    _check(case, write_safetensors(root / "bfl.safetensors", out), "bfl")


def test_kohya(case):
    root, path, *_ = case
    out = {}
    for m, (down, up) in _bfl_modules(_factors(path)).items():
        if "modulation" in m or m.startswith("final_layer.adaLN"):
            continue  # diffusers' kohya converter drops these (module docstring)
        key, rank = "lora_unet_" + m.replace(".", "_"), down.shape[0]
        alpha = ALPHA * rank / RANK  # the same alpha / rank as the PEFT adapter's
        out[key + ".lora_down.weight"], out[key + ".alpha"] = down, np.float32(alpha)
        out[key + ".lora_up.weight"] = up * (rank / alpha)  # the file's up, before alpha / rank
    _check(case, write_safetensors(root / "kohya.safetensors", out), "kohya")


def test_bfl_final_modulation_is_swapped_into_diffusers_order(case):
    root, path, fwd, *_ = case
    (down, up) = _factors(path)["norm_out.linear"]
    bfl = _bfl_modules({"norm_out.linear": (down, up)})["final_layer.adaLN_modulation.1"]
    peft = write_safetensors(
        root / "final-peft.safetensors",
        {"norm_out.linear.lora_A.weight": down, "norm_out.linear.lora_B.weight": up},
    )
    swapped = write_safetensors(
        root / "final-bfl.safetensors",
        {"diffusion_model.final_layer.adaLN_modulation.1.lora_A.weight": bfl[0],
         "diffusion_model.final_layer.adaLN_modulation.1.lora_B.weight": bfl[1]},
    )  # fmt: skip
    (a,), (b,) = read_lora(peft, fwd.model_config).updates, read_lora(swapped, fwd.model_config).updates
    assert a.target == b.target == "norm_out.kernel"
    np.testing.assert_allclose(b.a @ b.b, a.a @ a.b, rtol=1e-6, atol=1e-7)
