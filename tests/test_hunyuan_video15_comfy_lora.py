"""HunyuanVideo 1.5 LoRAs in ComfyUI's and the original checkpoint's layouts, fused by jaxdit on a tensor2
x ulysses2 mesh, against diffusers' ``HunyuanVideo15Transformer3DModel`` with the equivalent PEFT adapter
loaded by its own ``load_lora_adapter``.

One PEFT adapter (random factors, rank 4, alpha 8: scale 2) on every Linear and on the patch embedding's
Conv3d, written by diffusers' ``save_lora_adapter``, then rewritten by this file in each layout with the
module names of ``hunyuan_video15_original_names.py`` (the tests' own reading of diffusers' conversion
script and ComfyUI's loader): a fused qkv module carries q, k and v as one rank-12 update (the three
``lora_A`` stacked, the ``lora_B`` block-diagonal, alpha 24: the same scale), the final modulation's
``lora_up`` rows swap halves ((shift, scale)). The adapter moves the output by far more than the bound, so
a wrong mapping cannot pass.
"""

from __future__ import annotations

import copy
import json

import hunyuan_video15_original_names as names
import hunyuan_video15_tiny as tiny
import lora_tiny
import numpy as np
import pytest
import tolerance as tol
import torch

from converters.lora import read_lora
from converters.safetensors_io import SafetensorsFile, write_safetensors
from jaxdit import load_transformer
from jaxdit.lora import fuse_loras, unfuse_loras
from jaxdit.mesh import ParallelConfig

pytest.importorskip("diffusers")

SCALE = 0.8
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("hv15-comfy-lora")
    base = tiny.transformer(seed=3)
    base.save_pretrained(root / "transformer")
    targets = sorted(
        name for name, m in base.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv3d))
    )
    path = lora_tiny.write_peft(base, root / "peft.safetensors", targets, rank=RANK, alpha=ALPHA)
    with SafetensorsFile(path) as f:
        peft = {k: f.read(k) for k in f}
        meta = json.loads(f.metadata["lora_adapter_metadata"])
    model = copy.deepcopy(base)
    model.load_lora_adapter(
        {k: torch.from_numpy(v) for k, v in peft.items()}, prefix=None, metadata=meta, adapter_name="h"
    )
    model.set_adapters(["h"], weights=[SCALE])
    x = tiny.inputs(3, 4, 6, [5, 2], [0, 2], image=3)
    fwd = load_transformer(root / "transformer", ParallelConfig(tensor=2, ulysses=2))
    return root, peft, fwd, x, tiny.reference(model, x), tiny.reference(base, x)


def rewrite(peft: dict[str, np.ndarray], *, fused_qkv: bool, key) -> dict[str, np.ndarray]:
    """The PEFT adapter's factors under the original modules; ``key(module, role)`` spells a key
    (role: "down", "up", "alpha")."""
    c = tiny.CONFIG
    modules = names.module_map(c["num_layers"], c["num_refiner_layers"], fused_qkv=fused_qkv)
    out: dict[str, np.ndarray] = {}
    thirds: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for k in peft:
        if not k.endswith(".lora_A.weight"):
            continue
        module = k[: -len(".lora_A.weight")]
        down, up = peft[k], peft[f"{module}.lora_B.weight"]
        name, part = modules[module]
        if module == names.SWAPPED:
            up = names.swap_halves(up)
        if part is None:
            out |= {key(name, "down"): down, key(name, "up"): up, key(name, "alpha"): np.float32(ALPHA)}
        else:
            thirds.setdefault(name, {})[part] = (down, up)
    for name, parts in thirds.items():
        downs = [parts[n][0] for n in range(3)]
        ups = [parts[n][1] for n in range(3)]
        rows, rank = ups[0].shape
        up = np.zeros((3 * rows, 3 * rank), np.float32)
        for n, u in enumerate(ups):
            up[n * rows : (n + 1) * rows, n * rank : (n + 1) * rank] = u
        out |= {
            key(name, "down"): np.concatenate(downs),
            key(name, "up"): up,
            key(name, "alpha"): np.float32(3 * ALPHA),
        }
    return out


KOHYA = {"down": "lora_down.weight", "up": "lora_up.weight", "alpha": "alpha"}
PEFT = {"down": "lora_A.weight", "up": "lora_B.weight", "alpha": "alpha"}

LAYOUTS = {
    # ComfyUI's own module tree, kohya-style factor names (what its loader maps for HunyuanVideo models).
    "comfyui": (True, lambda m, r: f"diffusion_model.{names.comfy_module(m)}.{KOHYA[r]}"),
    # Tencent's module names (split q, k, v), PEFT-style factor names.
    "original": (False, lambda m, r: f"diffusion_model.{m}.{PEFT[r]}"),
    # The names of Comfy-Org's file (fused qkv) under ``transformer.`` (diffusion-pipe).
    "comfyui-original": (True, lambda m, r: f"transformer.{m}.{PEFT[r]}"),
    # musubi-tuner: Tencent's module names with underscores.
    "kohya-original": (False, lambda m, r: f"lora_unet_{m.replace('.', '_')}.{KOHYA[r]}"),
    # ComfyUI's module tree with underscores (its loader's ``lora_unet_`` keys).
    "kohya": (True, lambda m, r: f"lora_unet_{names.comfy_module(m).replace('.', '_')}.{KOHYA[r]}"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_diffusers(case, layout):
    root, peft, fwd, x, want, base = case
    fused_qkv, key = LAYOUTS[layout]
    path = write_safetensors(root / f"{layout}.safetensors", rewrite(peft, fused_qkv=fused_qkv, key=key))
    assert read_lora(path, fwd.config).layout == layout
    fused = fuse_loras(fwd.params, fwd.config, [(path, SCALE)])
    try:
        got = fwd(**x)
    finally:
        unfuse_loras(fwd.params, fused)
    effect = float(np.abs(want - base).max())
    print(
        f"HunyuanVideo 1.5 {layout}: the LoRA moves the output by {effect:.3f}; {tol.max_error(got, want):.2e} off"
    )
    assert effect > 100 * tol.TORCH_FORWARD.allowed(np.abs(want).max())
    tol.check(got, want, tol.TORCH_FORWARD, f"HunyuanVideo 1.5 LoRA ({layout}) vs diffusers")
    tol.check(fwd(**x), base, tol.TORCH_FORWARD, "HunyuanVideo 1.5 after unfusing vs the base model")
