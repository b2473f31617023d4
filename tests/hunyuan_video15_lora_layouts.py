"""A PEFT adapter of the tiny HunyuanVideo 1.5 transformer rewritten in the LoRA layouts of ComfyUI,
Tencent's original checkpoint, diffusion-pipe and kohya / musubi-tuner, with the module names of
``hunyuan_video15_original_names.py`` (the tests' own reading of diffusers' conversion script and
ComfyUI's loader).

A fused qkv module carries q, k and v as one rank-3r update (the three ``lora_A`` stacked, the ``lora_B``
block-diagonal, alpha tripled: the same scale); the final modulation's ``lora_up`` rows swap halves
((shift, scale)).
"""

from __future__ import annotations

import hunyuan_video15_original_names as names
import hunyuan_video15_tiny as tiny
import numpy as np


def rewrite(peft: dict[str, np.ndarray], alpha: float, *, fused_qkv: bool, key) -> dict[str, np.ndarray]:
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
            out |= {key(name, "down"): down, key(name, "up"): up, key(name, "alpha"): np.float32(alpha)}
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
            key(name, "alpha"): np.float32(3 * alpha),
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
