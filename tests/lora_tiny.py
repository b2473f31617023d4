"""LoRA files for the tiny FLUX and Wan models (tests/flux_tiny.py, tests/wan_tiny.py), and diffusers' output
with them fused, shared by the LoRA tests.

Files in diffusers' own layout are written by PEFT (``add_adapter`` with random, non-zero factors, then
diffusers' ``save_lora_adapter`` or the pipeline's ``save_lora_weights``); the other layouts have no
writer here, so their keys are built by hand from the base layouts' module names and shapes. diffusers
reads every file through its own converters (``lora_state_dict``), loads it with ``load_lora_adapter``,
and fuses it with ``set_adapters`` + ``fuse_lora``: the reference the tests compare against.
"""

from __future__ import annotations

import atexit
import copy
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import flux_tiny
import numpy as np
import torch
import wan_tiny
from diffusers import FluxPipeline, WanPipeline
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from converters.flux import bfl_table
from converters.flux import diffusers_to_params as flux_params
from converters.keymap import invert
from converters.safetensors_io import write_safetensors
from converters.wan import diffusers_to_params as wan_params
from converters.wan import original_table

GUIDANCE = True  # the FLUX-dev-like tiny model
ROOT = Path(tempfile.mkdtemp(prefix="jaxdit-lora-"))
atexit.register(shutil.rmtree, ROOT, ignore_errors=True)


def flux_base():
    return flux_tiny.model(GUIDANCE)


def wan_base():
    return wan_tiny.model(False)


def bfl_shapes() -> dict[str, tuple[int, ...]]:
    """BFL key -> shape of the tiny FLUX model."""
    cfg = flux_tiny.config(GUIDANCE)
    return {
        k: v.shape
        for k, v in invert(bfl_table(cfg), flux_params(cfg, flux_tiny.state_dict(GUIDANCE))).items()
    }


def original_shapes() -> dict[str, tuple[int, ...]]:
    """Original Wan key -> shape of the tiny Wan model."""
    cfg = wan_tiny.config(False)
    return {
        k: v.shape
        for k, v in invert(original_table(cfg), wan_params(cfg, wan_tiny.state_dict(False))).items()
    }


def linear_modules(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Modules with a 2-D weight (the Linear layers a LoRA targets)."""
    return sorted(k[: -len(".weight")] for k, s in shapes.items() if k.endswith(".weight") and len(s) == 2)


def factors(rng: np.random.Generator, out: int, inp: int, rank: int, scale: float = 0.1):
    """Random (down [r, in], up [out, r]) whose product is of order ``scale``."""
    down = rng.standard_normal((rank, inp)).astype(np.float32) / np.sqrt(inp)
    up = (scale * rng.standard_normal((out, rank))).astype(np.float32) / np.sqrt(rank)
    return down, up


def write_kohya_style(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    modules: Iterable[str],
    *,
    prefix: str,
    underscore: bool,
    names: tuple[str, str] = ("lora_down", "lora_up"),
    rank: int = 4,
    alpha: float | None = 2.0,
    seed: int = 0,
    alpha_equal_rank: Sequence[str] = (),
) -> Path:
    """A LoRA on ``modules`` of a base layout, keyed ``{prefix}{module}.{lora_down|lora_up}.weight`` (+ alpha).

    ``underscore``: module dots become underscores (kohya, musubi-tuner). Modules in ``alpha_equal_rank``
    get alpha = rank (diffusers' kohya converter drops the final layer's alpha).
    """
    rng = np.random.default_rng(seed)
    tensors = {}
    for module in modules:
        out, inp = shapes[module + ".weight"]
        down, up = factors(rng, out, inp, rank)
        key = prefix + (module.replace(".", "_") if underscore else module)
        tensors[f"{key}.{names[0]}.weight"] = down
        tensors[f"{key}.{names[1]}.weight"] = up
        if alpha is not None:
            a = float(rank) if module in alpha_equal_rank else alpha
            tensors[f"{key}.alpha"] = np.array(a, np.float32)
    return write_safetensors(path, tensors)


def write_peft(
    base: torch.nn.Module,
    path: Path,
    target_modules: list[str],
    *,
    pipeline=None,
    rank: int = 4,
    alpha: float = 8.0,
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
    lora_bias: bool = False,
    seed: int = 0,
) -> Path:
    """A diffusers-layout LoRA written by PEFT + diffusers: ``model.save_lora_adapter`` (keys without a
    prefix) or, with ``pipeline``, ``pipeline.save_lora_weights`` (``transformer.`` keys). Returns the file."""
    torch.manual_seed(seed)
    model = copy.deepcopy(base)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        lora_bias=lora_bias,
        init_lora_weights=False,  # random factors: lora_B is not zero
    )
    model.add_adapter(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    folder = path.parent / (path.stem + "-folder")
    with warnings.catch_warnings():  # PEFT takes lora_bias's 1-D lora_B.bias for an unsaved ZeRO-3 shard
        warnings.filterwarnings("ignore", message=".*invalid shape")
        if pipeline is None:
            model.save_lora_adapter(folder, weight_name="lora.safetensors")
        else:
            pipeline.save_lora_weights(
                folder,
                transformer_lora_layers=get_peft_model_state_dict(model),
                transformer_lora_adapter_metadata=model.peft_config["default"].to_dict(),
                weight_name="lora.safetensors",
            )
    (folder / "lora.safetensors").rename(path)
    folder.rmdir()
    return path


def _torch(tensors: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}


def diffusers_fused(family: str, loras: Sequence[tuple[object, float]]) -> torch.nn.Module:
    """The tiny base model with ``loras`` ((file or converted PEFT state dict, scale)) loaded and fused by
    diffusers. A state dict is taken as already converted (``transformer.``-prefixed PEFT keys)."""
    model = copy.deepcopy(flux_base() if family == "flux" else wan_base())
    names, weights = [], []
    for i, (source, scale) in enumerate(loras):
        alphas, meta = None, None
        if isinstance(source, dict):
            sd = source
        elif family == "flux":
            sd, alphas, meta = FluxPipeline.lora_state_dict(
                str(source), return_alphas=True, return_lora_metadata=True
            )
        else:
            sd, meta = WanPipeline.lora_state_dict(str(source), return_lora_metadata=True)
        prefix = "transformer" if any(k.startswith("transformer.") for k in sd) else None
        name = f"lora{i}"
        model.load_lora_adapter(
            sd, prefix=prefix, network_alphas=alphas or None, metadata=meta, adapter_name=name
        )
        names.append(name)
        weights.append(scale)
    model.set_adapters(names, weights=weights)
    model.fuse_lora(adapter_names=names)
    return model


def run(model: torch.nn.Module, x: dict) -> np.ndarray:
    t = {k: None if v is None else torch.from_numpy(np.asarray(v)) for k, v in x.items()}
    with torch.no_grad():
        return model(**t).sample.numpy()


def kohya_flux_to_peft(tensors: dict[str, np.ndarray], dims: Sequence[int]) -> dict[str, torch.Tensor]:
    """diffusers' conversion of kohya single-block ``linear1`` LoRAs (its converter fixes FLUX.1's sizes,
    3072 x 3 + 12288): q, k, v and the MLP input share ``lora_down`` (times alpha / rank) and split
    ``lora_up`` by rows ``dims``."""
    out = {}
    for key in [k for k in tensors if k.endswith("_linear1.lora_down.weight")]:
        base = key[: -len(".lora_down.weight")]
        i = int(base.split("_")[-2])
        down, up = tensors[key], tensors[base + ".lora_up.weight"]
        alpha = float(tensors.get(base + ".alpha", down.shape[0]))
        down = down * np.float32(alpha / down.shape[0])
        starts = np.cumsum([0, *dims])
        for name, lo, hi in zip(
            ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), starts, starts[1:], strict=False
        ):
            prefix = f"transformer.single_transformer_blocks.{i}.{name}"
            out[prefix + ".lora_A.weight"] = torch.from_numpy(down.copy())
            out[prefix + ".lora_B.weight"] = torch.from_numpy(np.ascontiguousarray(up[lo:hi]))
    return out


def converted_flux(tensors: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """diffusers' own conversion of a kohya/ComfyUI FLUX LoRA state dict (without ``linear1`` keys)."""
    return FluxPipeline.lora_state_dict(_torch(tensors))
