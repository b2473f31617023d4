"""The original HunyuanVideo 1.5 module names of a diffusers model, written for the tests from diffusers'
``scripts/convert_hunyuan_video1_5_to_diffusers.py`` (read in the other direction; the installed package
does not ship the script) and ComfyUI's ``process_unet_state_dict`` for HunyuanVideo models
(``comfy/supported_models.py``): independent of ``converters/hunyuan_video15.py``'s tables, which the
tests check against it.
"""

from __future__ import annotations

import numpy as np

#: diffusers' final ``norm_out.linear`` is (scale, shift); the original ``final_layer.adaLN_modulation.1``
#: (shift, scale).
SWAPPED = "norm_out.linear"


def module_map(
    num_layers: int, num_refiner_layers: int, *, fused_qkv: bool
) -> dict[str, tuple[str, int | None]]:
    """diffusers module -> (original module, third of it or None). ``fused_qkv``: the double blocks' q, k, v
    as ComfyUI's ``img_attn_qkv`` / ``txt_attn_qkv`` (Tencent's are separate; the refiner's always fused)."""
    tte = "context_embedder.time_text_embed"
    m = {
        "x_embedder.proj": "img_in.proj",
        "cond_type_embed": "cond_type_embedding",
        "time_embed.timestep_embedder.linear_1": "time_in.mlp.0",
        "time_embed.timestep_embedder.linear_2": "time_in.mlp.2",
        f"{tte}.timestep_embedder.linear_1": "txt_in.t_embedder.mlp.0",
        f"{tte}.timestep_embedder.linear_2": "txt_in.t_embedder.mlp.2",
        f"{tte}.text_embedder.linear_1": "txt_in.c_embedder.linear_1",
        f"{tte}.text_embedder.linear_2": "txt_in.c_embedder.linear_2",
        "context_embedder.proj_in": "txt_in.input_embedder",
        "context_embedder_2.norm": "byt5_in.layernorm",
        "context_embedder_2.linear_1": "byt5_in.fc1",
        "context_embedder_2.linear_2": "byt5_in.fc2",
        "context_embedder_2.linear_3": "byt5_in.fc3",
        "image_embedder.norm_in": "vision_in.proj.0",
        "image_embedder.linear_1": "vision_in.proj.1",
        "image_embedder.linear_2": "vision_in.proj.3",
        "image_embedder.norm_out": "vision_in.proj.4",
        "proj_out": "final_layer.linear",
        "norm_out.linear": "final_layer.adaLN_modulation.1",
    }
    out: dict[str, tuple[str, int | None]] = {k: (v, None) for k, v in m.items()}
    for i in range(num_refiner_layers):
        src, dst = (
            f"context_embedder.token_refiner.refiner_blocks.{i}",
            f"txt_in.individual_token_refiner.blocks.{i}",
        )
        for n, p in enumerate("qkv"):
            out[f"{src}.attn.to_{p}"] = (f"{dst}.self_attn_qkv", n)
        for a, b in (
            ("norm1", "norm1"),
            ("norm2", "norm2"),
            ("attn.to_out.0", "self_attn_proj"),
            ("ff.net.0.proj", "mlp.fc1"),
            ("ff.net.2", "mlp.fc2"),
            ("norm_out.linear", "adaLN_modulation.1"),
        ):
            out[f"{src}.{a}"] = (f"{dst}.{b}", None)
    for i in range(num_layers):
        src, dst = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for n, p in enumerate("qkv"):
            for stream, name in (("img", f"attn.to_{p}"), ("txt", f"attn.add_{p}_proj")):
                out[f"{src}.{name}"] = (
                    (f"{dst}.{stream}_attn_qkv", n) if fused_qkv else (f"{dst}.{stream}_attn_{p}", None)
                )
        for a, b in (
            ("norm1.linear", "img_mod.linear"),
            ("norm1_context.linear", "txt_mod.linear"),
            ("attn.norm_q", "img_attn_q_norm"),
            ("attn.norm_k", "img_attn_k_norm"),
            ("attn.norm_added_q", "txt_attn_q_norm"),
            ("attn.norm_added_k", "txt_attn_k_norm"),
            ("attn.to_out.0", "img_attn_proj"),
            ("attn.to_add_out", "txt_attn_proj"),
            ("ff.net.0.proj", "img_mlp.fc1"),
            ("ff.net.2", "img_mlp.fc2"),
            ("ff_context.net.0.proj", "txt_mlp.fc1"),
            ("ff_context.net.2", "txt_mlp.fc2"),
        ):
            out[f"{src}.{a}"] = (f"{dst}.{b}", None)
    return out


def comfy_module(original: str) -> str:
    """ComfyUI's name of an original module (of the fused file): its loader's renames."""
    name = original + "."
    for old, new in (
        ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
        ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
        ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
        ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
        ("time_in.mlp.0.", "time_in.in_layer."),
        ("time_in.mlp.2.", "time_in.out_layer."),
        ("_mod.linear.", "_mod.lin."),
        ("_attn_qkv.", "_attn.qkv."),
        ("_attn_proj.", "_attn.proj."),
        ("mlp.fc1.", "mlp.0."),
        ("mlp.fc2.", "mlp.2."),
    ):
        name = name.replace(old, new)
    return name[:-1]


def swap_halves(x: np.ndarray) -> np.ndarray:
    a, b = np.split(x, 2, axis=0)
    return np.concatenate([b, a], axis=0)


def original_state_dict(
    sd: dict[str, np.ndarray], num_layers: int, num_refiner_layers: int, *, fused_qkv: bool
):
    """A diffusers state dict in the original layout (Tencent's, or ComfyUI's file with ``fused_qkv``)."""
    out: dict[str, np.ndarray] = {}
    parts: dict[str, dict[int, np.ndarray]] = {}
    for key, value in sd.items():
        module, param = key.rsplit(".", 1)
        name, part = module_map(num_layers, num_refiner_layers, fused_qkv=fused_qkv)[module]
        if module == SWAPPED:
            value = swap_halves(value)
        if part is None:
            out[f"{name}.{param}"] = value
        else:
            parts.setdefault(f"{name}.{param}", {})[part] = value
    for key, thirds in parts.items():
        out[key] = np.concatenate([thirds[n] for n in range(3)], axis=0)
    return out
