"""Wan LoRAs in every layout jaxdit reads, fused on a tensor2 x ulysses2 mesh, against diffusers.

As tests/test_lora_flux.py, on the tiny Wan T2V transformer (tests/wan_tiny.py): each file fused by
jaxdit and run on the mesh equals diffusers' model with the same file loaded and fused
(``tolerance.TORCH_FORWARD_WAN``, the bound of the same forward without a LoRA).
ComfyUI's full deltas (``.diff`` of weights, norms and modulation tables, ``.diff_b``) and LoRAs on the
embeddings, which diffusers drops or cannot read, are checked against the base weights plus the deltas,
added under diffusers' names and converted by the diffusers key table.
"""

import functools

import lora_tiny
import numpy as np
import tolerance as tol
import wan_tiny
from diffusers import WanPipeline
from flax import nnx

from converters.lora import read_lora
from converters.safetensors_io import SafetensorsFile, write_safetensors
from converters.wan import diffusers_to_params
from jaxdit import load_transformer
from jaxdit.lora import fuse_loras, unfuse_loras
from jaxdit.mesh import ParallelConfig

MESH = ParallelConfig(tensor=2, ulysses=2)
FAST = {"xla_backend_optimization_level": 0}
SCALE = 0.8
ATTENTION = ("q", "k", "v", "o")


@functools.cache
def _forward():
    return load_transformer(wan_tiny.diffusers_folder(False), MESH, compiler_options=FAST)


def _params(fwd) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(fwd.params)}


def _block_modules() -> list[str]:
    modules = []
    for i in range(wan_tiny.LAYERS):
        modules += [f"blocks.{i}.{attn}.{p}" for attn in ("self_attn", "cross_attn") for p in ATTENTION]
        modules += [f"blocks.{i}.ffn.0", f"blocks.{i}.ffn.2"]
    return modules


def _check(name: str, loras, reference) -> float:
    fwd = _forward()
    x, base = wan_tiny.case(False)
    before = _params(fwd)
    fused = fuse_loras(fwd.params, fwd.config, loras, compiler_options=FAST)
    try:
        out = np.asarray(fwd(**x))
        during = _params(fwd)
    finally:
        unfuse_loras(fwd.params, fused)
    ref = lora_tiny.run(reference, x)
    effect = float(np.abs(ref - base).max())
    print(f"Wan {name}: the LoRA moves the output by {effect:.3f}")
    assert effect > 100 * tol.TORCH_FORWARD_WAN.allowed(np.abs(ref).max())
    err = tol.check(out, ref, tol.TORCH_FORWARD_WAN, f"Wan {name} vs diffusers")
    for key, value in _params(fwd).items():  # unfused: back within one rounding of the fused weight
        bound = np.spacing(np.maximum(np.abs(before[key]), np.abs(during[key])))
        assert np.all(np.abs(value - before[key]) <= bound), key
    return err


def test_comfyui():
    """``diffusion_model.blocks.N...`` with lora_down/lora_up, alpha and ``.diff_b`` bias deltas."""
    shapes = lora_tiny.original_shapes()
    modules = _block_modules()
    path = lora_tiny.ROOT / "wan-comfyui.safetensors"
    lora_tiny.write_kohya_style(path, shapes, modules, prefix="diffusion_model.", underscore=False, seed=21)
    with SafetensorsFile(path) as f:
        tensors = {k: f.read(k) for k in f}
    rng = np.random.default_rng(22)
    for m in modules:
        tensors[f"diffusion_model.{m}.diff_b"] = (0.05 * rng.standard_normal(shapes[m + ".bias"])).astype(
            np.float32
        )
    write_safetensors(path, tensors)
    assert read_lora(path, wan_tiny.config(False)).layout == "comfyui"
    _check("comfyui", [(path, SCALE)], lora_tiny.diffusers_fused("wan", [(path, SCALE)]))


def test_musubi():
    """musubi-tuner's ``lora_unet_blocks_N_...`` keys, alpha required."""
    path = lora_tiny.write_kohya_style(
        lora_tiny.ROOT / "wan-musubi.safetensors",
        lora_tiny.original_shapes(),
        _block_modules(),
        prefix="lora_unet_",
        underscore=True,
        alpha=3.0,
        seed=23,
    )
    assert read_lora(path, wan_tiny.config(False)).layout == "musubi"
    _check("musubi", [(path, SCALE)], lora_tiny.diffusers_fused("wan", [(path, SCALE)]))


def test_diffusers_peft():
    """A file written by PEFT + ``WanPipeline.save_lora_weights`` (``transformer.`` keys, config in the
    header), on attention, FFN, head and the condition embedder (whose time layers jaxdit keeps fp32)."""
    targets = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "proj_out", "time_proj"]
    targets += ["linear_1", "linear_2"]
    path = lora_tiny.write_peft(
        wan_tiny.model(False),
        lora_tiny.ROOT / "wan-peft.safetensors",
        targets,
        pipeline=WanPipeline,
        alpha=6.0,
        rank_pattern={"ffn.net.2": 2},
        seed=24,
    )
    assert read_lora(path, wan_tiny.config(False)).layout == "diffusers"
    _check("diffusers (PEFT)", [(path, SCALE)], lora_tiny.diffusers_fused("wan", [(path, SCALE)]))


def test_comfyui_full_deltas_and_embeddings():
    """``.diff`` of a weight, a norm (affine cross-attention norm, QK norm), modulation tables (stored
    [1, 6, E], held [6, E]), the head and the Conv3d patch embedding, ``.diff_b``, and low-rank updates of
    the patch embedding (a Conv3d LoRA), the time projection and the text embedding: the fused weights
    equal the base plus the deltas (fp32, up to the order of summation)."""
    cfg = wan_tiny.config(False)
    shapes = lora_tiny.original_shapes()
    rng = np.random.default_rng(25)
    rand = lambda shape: (0.05 * rng.standard_normal(shape)).astype(np.float32)
    # original module -> diffusers module (the renames of converters/wan.py's two tables)
    diffs = {
        "blocks.0.self_attn.q": "blocks.0.attn1.to_q",
        "blocks.1.norm3": "blocks.1.norm2",
        "blocks.0.self_attn.norm_q": "blocks.0.attn1.norm_q",
        "head.head": "proj_out",
        "patch_embedding": "patch_embedding",
    }
    raw = {"blocks.1.modulation": "blocks.1.scale_shift_table", "head.modulation": "scale_shift_table"}
    factored = {
        "time_projection.1": "condition_embedder.time_proj",
        "text_embedding.0": "condition_embedder.text_embedder.linear_1",
        "patch_embedding": "patch_embedding",
    }
    tensors, expected = {}, dict(wan_tiny.state_dict(False))
    for original, name in diffs.items():
        tensors[f"diffusion_model.{original}.diff"] = d = rand(shapes[original + ".weight"])
        expected[name + ".weight"] = expected[name + ".weight"] + SCALE * d
        if original + ".bias" in shapes:
            tensors[f"diffusion_model.{original}.diff_b"] = db = rand(shapes[original + ".bias"])
            expected[name + ".bias"] = expected[name + ".bias"] + SCALE * db
    for original, name in raw.items():
        tensors[f"diffusion_model.{original}.diff"] = d = rand(shapes[original])
        expected[name] = expected[name] + SCALE * d
    rank, alpha = 3, 1.5
    for original, name in factored.items():
        weight = shapes[original + ".weight"]
        down = rand((rank, *weight[1:]))
        up = rand((weight[0], rank) + (1,) * (len(weight) - 2))
        tensors[f"diffusion_model.{original}.lora_A.weight"] = down
        tensors[f"diffusion_model.{original}.lora_B.weight"] = up
        tensors[f"diffusion_model.{original}.alpha"] = np.array(alpha, np.float32)
        delta = (up.reshape(weight[0], rank) @ down.reshape(rank, -1)).reshape(weight)
        expected[name + ".weight"] = expected[name + ".weight"] + SCALE * alpha / rank * delta
    path = write_safetensors(lora_tiny.ROOT / "wan-comfyui-diff.safetensors", tensors)
    assert read_lora(path, cfg).layout == "comfyui"

    fwd = _forward()
    fused = fuse_loras(fwd.params, cfg, [(path, SCALE)], compiler_options=FAST)
    try:
        ours = _params(fwd)
    finally:
        unfuse_loras(fwd.params, fused)
    want = diffusers_to_params(cfg, expected)
    base = diffusers_to_params(cfg, wan_tiny.state_dict(False))
    changed = sorted(k for k in want if not np.array_equal(want[k], base[k]))
    print(changed)
    for k in want:
        tol.check(ours[k], want[k], tol.LORA_WEIGHTS, f"Wan ComfyUI full deltas: fused vs base + delta, {k}")
