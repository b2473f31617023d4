"""HunyuanVideo 1.5 transformer checkpoints -> jaxdit parameters (``jaxdit/models/hunyuan_video15.py``).

Layouts:

- diffusers ``HunyuanVideo15Transformer3DModel``: a ``transformer/`` folder (``config.json`` +
  safetensors, sharded with an index as the hunyuanvideo-community folders ship it) or the pipeline folder
  holding it;
- Tencent's original (``tencent/HunyuanVideo-1.5``'s ``transformer/480p_t2v/`` and the like: the folder with
  its ``config.json``, or the safetensors file alone): ``double_blocks`` with separate ``img_attn_q`` /
  ``_k`` / ``_v``, the token refiner's fused ``self_attn_qkv``, ``final_layer.adaLN_modulation.1`` in
  (shift, scale) order, the names diffusers' ``scripts/convert_hunyuan_video1_5_to_diffusers.py`` reads;
- Comfy-Org's single-file repackage (what ComfyUI loads): the same names with each stream's q, k, v fused
  into ``img_attn_qkv`` / ``txt_attn_qkv``, bare or under ``model.diffusion_model.`` / ``diffusion_model.``.

jaxdit's parameters keep diffusers' names where they are one tensor (the token refiner's blocks are
stacked as ``refiner_blocks``), so the diffusers table is one rule per tensor: torch ``Linear`` weights
transposed to [in, out] kernels, the patch embedding's Conv3d weight flattened per patch; the original
tables are the same rules on the original names, fused tensors read in thirds. A single file's config
comes from its shapes (the RoPE split only for the released head width 128), a Tencent folder's from its
``config.json``. Every source key is consumed; a missing, extra or mis-shaped tensor is a
:class:`CheckpointError` naming the key and the file (``converters/keymap.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from converters.checkpoints import CheckpointFormat
from converters.errors import CheckpointError
from converters.keymap import (
    IDENTITY,
    TRANSPOSE,
    Hook,
    KeyRule,
    KeyTable,
    Slice,
    StateDict,
    SwapHalves,
    resolve,
    where,
)
from converters.safetensors_io import CheckpointFiles, LazyTensor, open_checkpoint
from jaxdit.models.hunyuan_video15 import abstract_model
from jaxdit.models.hunyuan_video15_config import HunyuanVideo15Config

__all__ = [
    "CHECKPOINTS",
    "HunyuanVideo15Checkpoint",
    "comfy_table",
    "config_from_shapes",
    "detect",
    "diffusers_table",
    "diffusers_to_params",
    "original_table",
]

DIFFUSERS_CLASS = "HunyuanVideo15Transformer3DModel"
BLOCKS, REFINER = "transformer_blocks", "refiner_blocks"


class _PatchKernel(LazyTensor):
    """A Conv3d weight [E, C, pt, ph, pw] read as [C*pt*ph*pw, E]. The weight is small (E x one patch),
    so a box reads all its patch features for the box's range of E."""

    def __init__(self, source: LazyTensor) -> None:
        self._source = source
        e, *patch = source.shape
        self.shape = (int(np.prod(patch)), e)
        self.dtype = source.dtype

    def _read(self, box):
        (lo, hi), (e_lo, e_hi) = box
        full = ((e_lo, e_hi),) + tuple((0, d) for d in self._source.shape[1:])
        block = self._source._read(full).reshape(e_hi - e_lo, -1)
        return np.ascontiguousarray(block.T[lo:hi])


@dataclasses.dataclass(frozen=True)
class PatchEmbedKernel(Hook):
    """The patch embedding's Conv3d weight [E, C, pt, ph, pw] (kernel = stride = patch) as the kernel of
    one linear map per patch [C*pt*ph*pw, E], features in the weight's own (c, t, h, w) order."""

    in_channels: int
    patch: tuple[int, int, int]
    name: ClassVar[str] = "patch_embed_kernel"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        src, want = sources[0], (self.in_channels, *self.patch)
        if src.ndim != 5 or tuple(src.shape[1:]) != want:
            raise ValueError(
                f"expects a Conv3d weight [E, {', '.join(map(str, want))}], got {tuple(src.shape)}"
            )
        return _PatchKernel(src)

    def invert(self, target: np.ndarray):
        src = np.asarray(target).T.reshape(target.shape[-1], self.in_channels, *self.patch)
        return [(0, tuple((0, d) for d in src.shape), np.ascontiguousarray(src))]


def _linear(target: str, source: str, stack: str | None = None) -> list[KeyRule]:
    return [
        KeyRule(f"{target}.kernel", f"{source}.weight", TRANSPOSE, stack),
        KeyRule(f"{target}.bias", f"{source}.bias", IDENTITY, stack),
    ]


def _norm(target: str, source: str, stack: str | None = None) -> list[KeyRule]:
    return [
        KeyRule(f"{target}.weight", f"{source}.weight", IDENTITY, stack),
        KeyRule(f"{target}.bias", f"{source}.bias", IDENTITY, stack),
    ]


def _mlp(target: str, source: str, stack: str) -> list[KeyRule]:
    """diffusers' ``FeedForward``: net.0.proj (in), net.2 (out)."""
    return _linear(f"{target}.proj", f"{source}.net.0.proj", stack) + _linear(
        f"{target}.out", f"{source}.net.2", stack
    )


def diffusers_table(cfg: HunyuanVideo15Config) -> KeyTable:
    """diffusers ``HunyuanVideo15Transformer3DModel`` state dict -> jaxdit parameters."""
    rules = [
        KeyRule("x_embedder.kernel", "x_embedder.proj.weight", PatchEmbedKernel(cfg.in_channels, cfg.patch)),
        KeyRule("x_embedder.bias", "x_embedder.proj.bias"),
    ]
    rules += _norm("image_embedder.norm_in", "image_embedder.norm_in")
    rules += _linear("image_embedder.linear_1", "image_embedder.linear_1")
    rules += _linear("image_embedder.linear_2", "image_embedder.linear_2")
    rules += _norm("image_embedder.norm_out", "image_embedder.norm_out")
    tte = "context_embedder.time_text_embed"
    for part in ("timestep_embedder", "text_embedder"):
        for lin in ("linear_1", "linear_2"):
            rules += _linear(f"context_embedder.{part}.{lin}", f"{tte}.{part}.{lin}")
    rules += _linear("context_embedder.proj_in", "context_embedder.proj_in")
    ref = "context_embedder.token_refiner.refiner_blocks.{i}"
    rules += _norm(f"{REFINER}.norm1", f"{ref}.norm1", REFINER)
    for name in ("to_q", "to_k", "to_v"):
        rules += _linear(f"{REFINER}.{name}", f"{ref}.attn.{name}", REFINER)
    rules += _linear(f"{REFINER}.to_out", f"{ref}.attn.to_out.0", REFINER)
    rules += _norm(f"{REFINER}.norm2", f"{ref}.norm2", REFINER)
    rules += _mlp(f"{REFINER}.ff", f"{ref}.ff", REFINER)
    rules += _linear(f"{REFINER}.norm_out", f"{ref}.norm_out.linear", REFINER)
    rules += _norm("context_embedder_2.norm", "context_embedder_2.norm")
    for lin in ("linear_1", "linear_2", "linear_3"):
        rules += _linear(f"context_embedder_2.{lin}", f"context_embedder_2.{lin}")
    for lin in ("linear_1", "linear_2"):
        rules += _linear(f"time_embed.{lin}", f"time_embed.timestep_embedder.{lin}")
        if cfg.use_meanflow:
            rules += _linear(f"time_embed_r.{lin}", f"time_embed.timestep_embedder_r.{lin}")
    rules.append(KeyRule("cond_type_embed", "cond_type_embed.weight"))
    blk = f"{BLOCKS}.{{i}}"
    rules += _linear(f"{BLOCKS}.norm1", f"{blk}.norm1.linear", BLOCKS)
    rules += _linear(f"{BLOCKS}.norm1_context", f"{blk}.norm1_context.linear", BLOCKS)
    for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"):
        rules += _linear(f"{BLOCKS}.{name}", f"{blk}.attn.{name}", BLOCKS)
    rules += _linear(f"{BLOCKS}.to_out", f"{blk}.attn.to_out.0", BLOCKS)
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        rules.append(KeyRule(f"{BLOCKS}.{name}", f"{blk}.attn.{name}.weight", IDENTITY, BLOCKS))
    rules += _mlp(f"{BLOCKS}.ff", f"{blk}.ff", BLOCKS) + _mlp(
        f"{BLOCKS}.ff_context", f"{blk}.ff_context", BLOCKS
    )
    # AdaLayerNormContinuous: (scale, shift), the order the model splits it in; no swap.
    rules += _linear("norm_out", "norm_out.linear") + _linear("proj_out", "proj_out")
    layers = {BLOCKS: cfg.num_layers, REFINER: cfg.num_refiner_layers}
    rules = [r for r in rules if r.stack is None or layers[r.stack] > 0]
    return KeyTable("HunyuanVideo 1.5 diffusers", tuple(rules), layers)


#: Original module names of the diffusers modules outside the block stacks.
_ORIGINAL_TOP = {
    "x_embedder.proj": "img_in.proj",
    "image_embedder.norm_in": "vision_in.proj.0",
    "image_embedder.linear_1": "vision_in.proj.1",
    "image_embedder.linear_2": "vision_in.proj.3",
    "image_embedder.norm_out": "vision_in.proj.4",
    "context_embedder.time_text_embed.timestep_embedder.linear_1": "txt_in.t_embedder.mlp.0",
    "context_embedder.time_text_embed.timestep_embedder.linear_2": "txt_in.t_embedder.mlp.2",
    "context_embedder.time_text_embed.text_embedder.linear_1": "txt_in.c_embedder.linear_1",
    "context_embedder.time_text_embed.text_embedder.linear_2": "txt_in.c_embedder.linear_2",
    "context_embedder.proj_in": "txt_in.input_embedder",
    "context_embedder_2.norm": "byt5_in.layernorm",
    "context_embedder_2.linear_1": "byt5_in.fc1",
    "context_embedder_2.linear_2": "byt5_in.fc2",
    "context_embedder_2.linear_3": "byt5_in.fc3",
    "time_embed.timestep_embedder.linear_1": "time_in.mlp.0",
    "time_embed.timestep_embedder.linear_2": "time_in.mlp.2",
    "time_embed.timestep_embedder_r.linear_1": "time_r_in.mlp.0",
    "time_embed.timestep_embedder_r.linear_2": "time_r_in.mlp.2",
    "cond_type_embed": "cond_type_embedding",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
    "proj_out": "final_layer.linear",
}
_ORIGINAL_REFINER = {
    "norm1": "norm1",
    "norm2": "norm2",
    "attn.to_out.0": "self_attn_proj",
    "ff.net.0.proj": "mlp.fc1",
    "ff.net.2": "mlp.fc2",
    "norm_out.linear": "adaLN_modulation.1",
}
_ORIGINAL_BLOCK = {
    "norm1.linear": "img_mod.linear",
    "norm1_context.linear": "txt_mod.linear",
    "attn.norm_q": "img_attn_q_norm",
    "attn.norm_k": "img_attn_k_norm",
    "attn.norm_added_q": "txt_attn_q_norm",
    "attn.norm_added_k": "txt_attn_k_norm",
    "attn.to_out.0": "img_attn_proj",
    "attn.to_add_out": "txt_attn_proj",
    "ff.net.0.proj": "img_mlp.fc1",
    "ff.net.2": "img_mlp.fc2",
    "ff_context.net.0.proj": "txt_mlp.fc1",
    "ff_context.net.2": "txt_mlp.fc2",
}
#: q, k, v of each attention: diffusers module -> (original stream, part).
_QKV = {
    "attn.to_q": ("img", 0),
    "attn.to_k": ("img", 1),
    "attn.to_v": ("img", 2),
    "attn.add_q_proj": ("txt", 0),
    "attn.add_k_proj": ("txt", 1),
    "attn.add_v_proj": ("txt", 2),
}
_REFINER_SRC = "context_embedder.token_refiner.refiner_blocks.{i}."
_BLOCK_SRC = f"{BLOCKS}.{{i}}."
ORIGINAL_REFINER, ORIGINAL_BLOCKS = "txt_in.individual_token_refiner.blocks.{i}.", "double_blocks.{i}."
#: Key prefixes of single files: ComfyUI's, or none (Tencent's).
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")
#: Keys only a HunyuanVideo 1.5 original file has together (how a single file is recognised): the token
#: refiner and SigLIP projection (HunyuanImage 2.1 has no ``vision_in``, HunyuanVideo 1.0 no ``byt5_in``).
MARKERS = (
    "txt_in.individual_token_refiner.blocks.0.norm1.weight",
    "vision_in.proj.0.weight",
    "byt5_in.fc1.weight",
)
#: The Tencent class a folder's ``config.json`` names.
ORIGINAL_CLASS = "HunyuanVideo_1_5_DiffusionTransformer"


def _qkv_hook(hook: Hook, part: int, width: int) -> Slice:
    """A third of a fused qkv (rows ``part``): the weight's transposed, the bias as it is."""
    return Slice(
        0, part * width, (part + 1) * width, transpose=hook is TRANSPOSE, label=f"split_qkv {'qkv'[part]}"
    )


def original_table(cfg: HunyuanVideo15Config, *, fused_qkv: bool = False) -> KeyTable:
    """The original checkpoint -> jaxdit parameters: diffusers' rules on Tencent's names.

    ``fused_qkv``: the double blocks' q, k, v as one ``img_attn_qkv`` / ``txt_attn_qkv`` (Comfy-Org's
    repackage) instead of Tencent's separate ``img_attn_q`` / ``_k`` / ``_v``. The token refiner's
    ``self_attn_qkv`` is fused in both; the final modulation is (shift, scale) where diffusers' is
    (scale, shift)."""
    diffusers = diffusers_table(cfg)
    e = cfg.hidden_size
    rules = []
    for rule in diffusers.rules:
        (source,) = rule.sources
        module, param = source.rsplit(".", 1)
        hook = rule.hook
        if module.startswith(_REFINER_SRC):
            inner = module[len(_REFINER_SRC) :]
            if inner in ("attn.to_q", "attn.to_k", "attn.to_v"):
                name, hook = "self_attn_qkv", _qkv_hook(hook, "qkv".index(inner[-1]), e)
            else:
                name = _ORIGINAL_REFINER[inner]
            module = ORIGINAL_REFINER + name
        elif module.startswith(_BLOCK_SRC):
            inner = module[len(_BLOCK_SRC) :]
            if inner in _QKV:
                stream, part = _QKV[inner]
                if fused_qkv:
                    name, hook = f"{stream}_attn_qkv", _qkv_hook(hook, part, e)
                else:
                    name = f"{stream}_attn_{'qkv'[part]}"
            else:
                name = _ORIGINAL_BLOCK[inner]
            module = ORIGINAL_BLOCKS + name
        else:
            if module == "norm_out.linear":
                hook = SwapHalves(transpose=hook is TRANSPOSE)
            module = _ORIGINAL_TOP[module]
        rules.append(KeyRule(rule.target, f"{module}.{param}", hook, rule.stack))
    name = "HunyuanVideo 1.5 " + ("ComfyUI (fused qkv)" if fused_qkv else "original")
    return KeyTable(name, tuple(rules), diffusers.layers)


#: ComfyUI's module names for the original file's (its ``process_unet_state_dict`` for HunyuanVideo
#: models, in ``comfy/supported_models.py``): key fragments, applied in order.
_COMFY_NAMES = (
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
    ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
    ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."),
    ("_attn_qkv.", "_attn.qkv."),
    ("mlp.fc1.", "mlp.0."),
    ("mlp.fc2.", "mlp.2."),
    ("_attn_q_norm.weight", "_attn.norm.query_norm.weight"),
    ("_attn_k_norm.weight", "_attn.norm.key_norm.weight"),
    ("_attn_proj.", "_attn.proj."),
    ("_in.mlp.2.", "_in.out_layer."),
    ("_in.mlp.0.", "_in.in_layer."),
)


def comfy_table(cfg: HunyuanVideo15Config) -> KeyTable:
    """ComfyUI's own module tree (what its LoRA loader names ``diffusion_model.double_blocks.0.img_attn.qkv``
    and the like) -> jaxdit parameters: the fused original table under ComfyUI's names."""
    fused = original_table(cfg, fused_qkv=True)
    rules = []
    for rule in fused.rules:
        (source,) = rule.sources
        for old, new in _COMFY_NAMES:
            source = source.replace(old, new)
        rules.append(KeyRule(rule.target, source, rule.hook, rule.stack))
    return KeyTable("HunyuanVideo 1.5 ComfyUI modules", tuple(rules), fused.layers)


def _depth(shapes: Mapping[str, tuple[int, ...]], template: str) -> int:
    head = template.split("{i}")[0]
    found = {int(k[len(head) :].split(".")[0]) for k in shapes if k.startswith(head)}
    return max(found) + 1 if found else 0


def config_from_shapes(shapes: Mapping[str, tuple[int, ...]], **known: Any) -> HunyuanVideo15Config:
    """An original file's config from its tensors' shapes (original keys, no prefix). ``known``: fields
    the shapes do not hold (a Tencent ``config.json``'s RoPE split, target size); without them the head
    width must be the released 128 (RoPE split (16, 56, 56))."""
    hidden, in_channels, *patch = shapes["img_in.proj.weight"]
    if len(patch) != 3 or patch[1] != patch[2]:
        raise CheckpointError(f"img_in.proj.weight {shapes['img_in.proj.weight']}: not a square 3-D patch")
    head_dim = shapes["double_blocks.0.img_attn_q_norm.weight"][0]
    if "rope_axes_dim" not in known and head_dim != 128:
        raise CheckpointError(
            f"head_dim {head_dim}: pass the config (the RoPE split is not in the weights; 128 means (16, 56, 56))"
        )
    pt, p = patch[0], patch[1]
    fc1 = "double_blocks.0.img_mlp.fc1.weight"
    return HunyuanVideo15Config(
        **{
            "in_channels": in_channels,
            "out_channels": shapes["final_layer.linear.weight"][0] // (pt * p * p),
            "num_attention_heads": hidden // head_dim,
            "attention_head_dim": head_dim,
            "num_layers": _depth(shapes, ORIGINAL_BLOCKS),
            "num_refiner_layers": _depth(shapes, ORIGINAL_REFINER),
            "mlp_ratio": shapes[fc1][0] / hidden,
            "patch_size": p,
            "patch_size_t": pt,
            "text_embed_dim": shapes["txt_in.input_embedder.weight"][1],
            "text_embed_2_dim": shapes["byt5_in.fc1.weight"][1],
            "image_embed_dim": shapes["vision_in.proj.0.weight"][0],
            "use_meanflow": "time_r_in.mlp.0.weight" in shapes,
            **known,
        }
    )


#: Tencent's ``ideal_resolution`` -> the target size diffusers' conversion script gives it.
_TARGET_SIZES = {"480p": 640, "720p": 960}


def _original_config(path: Path) -> tuple[dict[str, Any], bool]:
    """(config fields the weights do not hold, whether it is a Tencent config) of a Tencent folder's
    ``config.json`` (naming Tencent's class, or with its ``mm_double_blocks_depth``); ({}, False) when
    there is none."""
    file = path / "config.json"
    if not file.is_file():
        return {}, False
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read the config: {e}") from e
    if data.get("_class_name") != ORIGINAL_CLASS and "mm_double_blocks_depth" not in data:
        return {}, False
    for name, ok in (("mm_single_blocks_depth", 0), ("guidance_embed", False), ("text_pool_type", None)):
        if data.get(name, ok) != ok:
            raise CheckpointError(f"{file}: {name} {data[name]!r}: not a HunyuanVideo 1.5 layout jaxdit runs")
    if data.get("qk_norm_type", "rms") != "rms":
        raise CheckpointError(f"{file}: qk_norm_type {data['qk_norm_type']!r}: only 'rms' is supported")
    known: dict[str, Any] = {}
    if data.get("rope_dim_list") is not None:
        known["rope_axes_dim"] = tuple(data["rope_dim_list"])
    if data.get("rope_theta") is not None:
        known["rope_theta"] = float(data["rope_theta"])
    if data.get("ideal_resolution") in _TARGET_SIZES:
        known["target_size"] = _TARGET_SIZES[data["ideal_resolution"]]
    if data.get("ideal_task") in ("t2v", "i2v"):
        known["task_type"] = data["ideal_task"]
    return known, True


@dataclasses.dataclass
class HunyuanVideo15Checkpoint:
    """An opened HunyuanVideo 1.5 transformer checkpoint: its files, key prefix, config and layout."""

    files: CheckpointFiles
    prefix: str
    config: HunyuanVideo15Config
    layout: str = "diffusers"  # or "original" (Tencent's) or "comfyui" (fused qkv)

    @property
    def table(self) -> KeyTable:
        if self.layout == "diffusers":
            return diffusers_table(self.config)
        return original_table(self.config, fused_qkv=self.layout == "comfyui")

    @property
    def dtype(self) -> np.dtype:
        key = "x_embedder.proj.weight" if self.layout == "diffusers" else "img_in.proj.weight"
        return self.files.dtype(self.prefix + key)

    def resolve(self, expected: Mapping[str, tuple[int, ...]]):
        return resolve(self.table, self.files, expected, prefix=self.prefix)


def _diffusers_folder(path: Path) -> Path | None:
    """The folder holding a diffusers HunyuanVideo 1.5 transformer: ``path`` or a pipeline's
    ``transformer/``."""
    for folder in (path, path / "transformer"):
        cfg = folder / "config.json"
        if cfg.is_file():
            try:
                data = json.loads(cfg.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{cfg}: cannot read the config: {e}") from e
            if data.get("_class_name") == DIFFUSERS_CLASS:
                return folder
    return None


def _prefix(keys: set[str]) -> str | None:
    return next((p for p in PREFIXES if all(p + m in keys for m in MARKERS)), None)


def is_hunyuan_video15_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a HunyuanVideo 1.5 transformer: a diffusers folder, a Tencent folder, or an
    original / ComfyUI single file (cheap: config or header keys only)."""
    path = Path(path)
    if path.is_dir():
        if _diffusers_folder(path) is not None:
            return True
        if (path / "config.json").is_file() and not _original_config(path)[1]:
            return False
    try:
        keys = set(open_checkpoint(path).keys())
    except CheckpointError:
        return False
    return _prefix(keys) is not None


def detect(
    path: str | os.PathLike[str], config: HunyuanVideo15Config | Mapping[str, Any] | None = None
) -> HunyuanVideo15Checkpoint:
    """Open a HunyuanVideo 1.5 transformer checkpoint of any supported layout and work out its config
    (``config``, a ``HunyuanVideo15Config`` or a diffusers config dict, overrides it; shapes are still
    checked)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if isinstance(config, Mapping):
        config = HunyuanVideo15Config.from_diffusers(config)
    folder = _diffusers_folder(path) if path.is_dir() else None
    if folder is not None:
        try:
            cfg = config or HunyuanVideo15Config.from_diffusers(folder / "config.json")
        except ValueError as e:
            raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
        return HunyuanVideo15Checkpoint(open_checkpoint(folder), "", cfg)
    known, tencent = _original_config(path) if path.is_dir() else ({}, False)
    if path.is_dir() and (path / "config.json").is_file() and not tencent:
        raise CheckpointError(
            f"{path}: not a HunyuanVideo 1.5 transformer (its config.json names neither {DIFFUSERS_CLASS} "
            f"nor Tencent's {ORIGINAL_CLASS})"
        )
    files = open_checkpoint(path)
    keys = set(files.keys())
    prefix = _prefix(keys)
    if prefix is None:
        raise CheckpointError(
            f"{where(files)}: not a HunyuanVideo 1.5 transformer (no {' / '.join(MARKERS)}, bare or under "
            f"{' / '.join(p for p in PREFIXES if p)}; expected a diffusers {DIFFUSERS_CLASS} folder, Tencent's "
            "original checkpoint or ComfyUI's file)"
        )
    if any(k.startswith(prefix + "single_blocks.") for k in keys):
        raise CheckpointError(f"{where(files)}: has single-stream blocks; HunyuanVideo 1.5 has none")
    fused = prefix + "double_blocks.0.img_attn_qkv.weight" in keys
    if config is None:
        n = len(prefix)
        try:
            config = config_from_shapes(
                {k[n:]: files.shape(k) for k in keys if k.startswith(prefix)}, **known
            )
        except KeyError as e:
            raise CheckpointError(
                f"{where(files)}: cannot infer the HunyuanVideo 1.5 config, no tensor {e}"
            ) from None
        except ValueError as e:
            raise CheckpointError(f"{where(files)}: {e}") from None
    return HunyuanVideo15Checkpoint(files, prefix, config, "comfyui" if fused else "original")


def diffusers_to_params(cfg: HunyuanVideo15Config, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A diffusers state dict (numpy-convertible values) -> jaxdit parameter arrays, by path."""
    from jaxdit.models.hunyuan_video15 import parameter_shapes

    lazies = resolve(diffusers_table(cfg), StateDict(state_dict), parameter_shapes(cfg))
    return {p: np.asarray(t) for p, t in lazies.items()}


#: HunyuanVideo 1.5 transformer checkpoints as ``jaxdit.loading.params.load_params`` reads them.
CHECKPOINTS = CheckpointFormat(
    name="hunyuan-video15",
    detect=is_hunyuan_video15_checkpoint,
    open=detect,
    config_class=HunyuanVideo15Config,
    abstract_model=abstract_model,
)
