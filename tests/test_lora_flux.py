"""FLUX LoRAs in every layout jaxdit reads, fused on a tensor2 x ulysses2 mesh, against diffusers.

Each file is fused by jaxdit into the tiny FLUX transformer (tests/flux_tiny.py) loaded from its diffusers
folder, run on the mesh, and compared with diffusers' own model after ``load_lora_adapter`` +
``fuse_lora`` of the same file (``tolerance.TORCH_FORWARD_GUIDANCE_EMBED``, the bound of the same forward
without a LoRA: fusing adds little, 7.5e-6 relative against 6.8e-6; the LoRAs move the output by 0.03-0.3,
over 100x the bound, so a wrong mapping cannot pass). Unfusing after each test gives the base weights back
within one fp32 rounding, and the compiled step is the one compiled first (checked in
tests/test_lora_fuse.py).

Where diffusers 0.42.1 cannot read a tiny model's file, the reference uses diffusers' rule with the tiny
sizes, as said at each place: its kohya converter fixes FLUX.1's single-block sizes (3 x 3072 + 12288) to
split ``linear1``, and writes the embedders' and final layer's updates without the ``transformer.`` prefix
its loader keeps (so a real file's are dropped silently when it also has block updates).
"""

import functools

import flux_tiny
import lora_tiny
import numpy as np
import tolerance as tol
import torch
from diffusers import FluxPipeline
from flax import nnx

from converters.lora import read_lora
from converters.safetensors_io import SafetensorsFile, write_safetensors
from jaxdit import load_transformer
from jaxdit.lora import fuse_loras, switch_loras, unfuse_loras
from jaxdit.mesh import ParallelConfig

MESH = ParallelConfig(tensor=2, ulysses=2)
FAST = {"xla_backend_optimization_level": 0}  # quick CPU compiles; numerics are what is tested
SCALE = 0.8
FINAL = (
    "final_layer.adaLN_modulation.1",
    "final_layer.linear",
)  # diffusers ignores their alpha: alpha = rank
PEFT_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "proj_mlp",
    "proj_out",
    "linear",  # norm1.linear, norm1_context.linear, norm.linear, norm_out.linear
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "x_embedder",
    "context_embedder",
    "linear_1",  # the time, guidance and pooled-text embedders
    "linear_2",
]


@functools.cache
def _forward():
    return load_transformer(flux_tiny.diffusers_folder(lora_tiny.GUIDANCE), MESH, compiler_options=FAST)


def _params(fwd) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(fwd.params)}


def _check(name: str, loras, reference: torch.nn.Module) -> float:
    fwd = _forward()
    x, base = flux_tiny.case(lora_tiny.GUIDANCE)
    before = _params(fwd)
    fused = fuse_loras(fwd.params, fwd.config, loras, compiler_options=FAST)
    try:
        out = np.asarray(fwd(**x))
        during = _params(fwd)
    finally:
        unfuse_loras(fwd.params, fused)
    ref = lora_tiny.run(reference, x)
    effect = float(np.abs(ref - base).max())
    print(f"FLUX {name}: the LoRA moves the output by {effect:.3f}")
    assert effect > 100 * tol.TORCH_FORWARD_GUIDANCE_EMBED.allowed(np.abs(ref).max())
    err = tol.check(out, ref, tol.TORCH_FORWARD_GUIDANCE_EMBED, f"FLUX {name} vs diffusers")
    for key, value in _params(fwd).items():  # unfused: back within one rounding of the fused weight
        bound = np.spacing(np.maximum(np.abs(before[key]), np.abs(during[key])))
        assert np.all(np.abs(value - before[key]) <= bound), key
    return err


def _tensors(path) -> dict[str, np.ndarray]:
    with SafetensorsFile(path) as f:
        return {k: f.read(k) for k in f}


def _kohya_reference(tensors: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """diffusers' conversion of a kohya/ComfyUI file, with its tiny-size fixes (module docstring)."""
    cfg = flux_tiny.config(lora_tiny.GUIDANCE)
    rest = {k: v for k, v in tensors.items() if "_linear1." not in k}
    sd = {
        k if k.startswith("transformer.") else "transformer." + k: v
        for k, v in lora_tiny.converted_flux(rest).items()
    }
    sd.update(lora_tiny.kohya_flux_to_peft(tensors, [cfg.hidden_size] * 3 + [cfg.mlp_hidden]))
    return sd


def test_kohya():
    """sd-scripts' keys on every Linear of the model: fused qkv, single blocks' linear1 / linear2 split,
    modulations, embedders, final layer (swapped scale/shift halves)."""
    shapes = lora_tiny.bfl_shapes()
    path = lora_tiny.write_kohya_style(
        lora_tiny.ROOT / "flux-kohya.safetensors",
        shapes,
        lora_tiny.linear_modules(shapes),
        prefix="lora_unet_",
        underscore=True,
        alpha_equal_rank=FINAL,
    )
    assert read_lora(path, flux_tiny.config(lora_tiny.GUIDANCE)).layout == "kohya"
    reference = lora_tiny.diffusers_fused("flux", [(_kohya_reference(_tensors(path)), SCALE)])
    _check("kohya", [(path, SCALE)], reference)


def test_bfl_comfyui():
    """ComfyUI's ``diffusion_model.double_blocks...`` keys; lora_A/lora_B names and another prefix fuse the
    very same weights."""
    shapes = lora_tiny.bfl_shapes()
    modules = [m for m in lora_tiny.linear_modules(shapes) if "blocks" in m and "linear1" not in m]
    write = lambda name, **kw: lora_tiny.write_kohya_style(
        lora_tiny.ROOT / name, shapes, modules, underscore=False, seed=3, **kw
    )
    path = write("flux-bfl.safetensors", prefix="diffusion_model.")
    reference = lora_tiny.diffusers_fused("flux", [(_kohya_reference(_tensors(path)), SCALE)])
    _check("bfl (ComfyUI)", [(path, SCALE)], reference)
    cfg = flux_tiny.config(lora_tiny.GUIDANCE)
    other = write("flux-bfl-ab.safetensors", prefix="model.diffusion_model.", names=("lora_A", "lora_B"))
    one, two = read_lora(path, cfg), read_lora(other, cfg)
    assert one.layout == two.layout == "bfl"
    for u, v in zip(one.updates, two.updates, strict=True):
        assert (u.target, u.layer) == (v.target, v.layer)
        np.testing.assert_array_equal(u.a, v.a)
        np.testing.assert_array_equal(u.b, v.b)


def test_diffusers_peft():
    """A file written by PEFT + diffusers' ``save_lora_adapter`` (no key prefix, the LoraConfig in the
    header): per-module ranks and alphas (rank_pattern / alpha_pattern) and LoRA biases."""
    path = lora_tiny.write_peft(
        lora_tiny.flux_base(),
        lora_tiny.ROOT / "flux-peft.safetensors",
        PEFT_TARGETS,
        rank_pattern={"proj_mlp": 2},
        alpha_pattern={"to_q": 3.0},
        lora_bias=True,
    )
    assert read_lora(path, flux_tiny.config(lora_tiny.GUIDANCE)).layout == "diffusers"
    _check("diffusers (PEFT)", [(path, SCALE)], lora_tiny.diffusers_fused("flux", [(path, SCALE)]))


def test_xlabs():
    """XLabs' processor LoRAs: image / text qkv and projections of double blocks, the qkv rows of single
    blocks' linear1, and their linear2."""
    cfg = flux_tiny.config(lora_tiny.GUIDANCE)
    e, f, rank = cfg.hidden_size, cfg.mlp_hidden, 4
    rng = np.random.default_rng(5)
    tensors = {}
    for i in range(cfg.depth):
        for name, out in (("qkv_lora1", 3 * e), ("qkv_lora2", 3 * e), ("proj_lora1", e), ("proj_lora2", e)):
            down, up = lora_tiny.factors(rng, out, e, rank)
            tensors[f"double_blocks.{i}.processor.{name}.down.weight"] = down
            tensors[f"double_blocks.{i}.processor.{name}.up.weight"] = up
    for i in range(cfg.depth_single_blocks):
        for name, out, inp in (("qkv_lora", 3 * e, e), ("proj_lora", e, e + f)):
            down, up = lora_tiny.factors(rng, out, inp, rank)
            tensors[f"single_blocks.{i}.processor.{name}.down.weight"] = down
            tensors[f"single_blocks.{i}.processor.{name}.up.weight"] = up
    path = write_safetensors(lora_tiny.ROOT / "flux-xlabs.safetensors", tensors)
    assert read_lora(path, cfg).layout == "xlabs"
    _check("xlabs", [(path, SCALE)], lora_tiny.diffusers_fused("flux", [(path, SCALE)]))


def test_kohya_diffusers_names():
    """kohya's spelling of diffusers modules (``lora_transformer_...``; diffusers reads its attention
    modules only), alpha per module."""
    shapes = {k: tuple(v.shape) for k, v in flux_tiny.state_dict(lora_tiny.GUIDANCE).items()}
    cfg = flux_tiny.config(lora_tiny.GUIDANCE)
    double = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    modules = [f"transformer_blocks.{i}.attn.{m}" for i in range(cfg.depth) for m in double]
    modules += [
        f"single_transformer_blocks.{i}.attn.{m}" for i in range(cfg.depth_single_blocks) for m in double[:3]
    ]
    path = lora_tiny.write_kohya_style(
        lora_tiny.ROOT / "flux-kohya-diffusers.safetensors",
        shapes,
        modules,
        prefix="lora_transformer_",
        underscore=True,
        seed=7,
    )
    assert read_lora(path, flux_tiny.config(lora_tiny.GUIDANCE)).layout == "kohya-diffusers"
    _check("kohya-diffusers", [(path, SCALE)], lora_tiny.diffusers_fused("flux", [(path, SCALE)]))


def test_two_layouts_at_once():
    """A kohya file (scale 0.8) and a diffusers pipeline file (``transformer.`` keys, scale 0.5) fused in one
    pass equal diffusers with both adapters active at those weights."""
    shapes = lora_tiny.bfl_shapes()
    kohya = lora_tiny.write_kohya_style(
        lora_tiny.ROOT / "flux-two-kohya.safetensors",
        shapes,
        lora_tiny.linear_modules(shapes),
        prefix="lora_unet_",
        underscore=True,
        alpha_equal_rank=FINAL,
        seed=11,
    )
    peft = lora_tiny.write_peft(
        lora_tiny.flux_base(),
        lora_tiny.ROOT / "flux-two-peft.safetensors",
        PEFT_TARGETS,
        pipeline=FluxPipeline,
        seed=12,
    )
    assert read_lora(peft, flux_tiny.config(lora_tiny.GUIDANCE)).layout == "diffusers"
    reference = lora_tiny.diffusers_fused("flux", [(_kohya_reference(_tensors(kohya)), 0.8), (peft, 0.5)])
    _check("kohya + diffusers", [(kohya, 0.8), (peft, 0.5)], reference)


def test_step_compiled_once():
    """Fusing, switching and unfusing keep every parameter's shape, dtype and sharding: the step compiled
    for the first call of this module runs after all the fuses above and these, without recompiling."""
    fwd = _forward()
    x, _ = flux_tiny.case(lora_tiny.GUIDANCE)
    shapes = lora_tiny.bfl_shapes()
    files = [
        lora_tiny.write_kohya_style(
            lora_tiny.ROOT / f"flux-switch-{seed}.safetensors",
            shapes,
            lora_tiny.linear_modules(shapes),
            prefix="lora_unet_",
            underscore=True,
            seed=seed,
        )
        for seed in (31, 32)
    ]
    base = np.asarray(fwd(**x))
    fused = fuse_loras(fwd.params, fwd.config, [files[0]], compiler_options=FAST)
    one = np.asarray(fwd(**x))
    fused = switch_loras(fwd.params, fwd.config, fused, [(files[1], 0.5)])
    two = np.asarray(fwd(**x))
    unfuse_loras(fwd.params, fused)
    back = np.asarray(fwd(**x))
    steps = list(fwd.forward._steps.values())
    assert [step._cache_size() for step in steps] == [1]
    assert np.abs(one - base).max() > 1e-2 and np.abs(two - one).max() > 1e-2
    print("FLUX step compiled once")
    tol.check(back, base, tol.ROUNDING, "FLUX output after fuse, switch, unfuse vs base")
