"""Wan checkpoints (2.1 and 2.2) -> jaxdit parameters: the original and diffusers key tables, layout
detection, and export of the original layout.

Layouts (Wan-Video/Wan2.1 and Wan2.2 ``wan/modules/model.py`` and diffusers'
``scripts/convert_wan_to_diffusers.py`` name every key and shape; Wan 2.2's transformers use Wan 2.1's
keys, without the CLIP image projection ``img_emb`` in I2V-A14B):

- Original (``Wan-AI/Wan2.1-T2V-1.3B``, ``-T2V-14B``, ``-I2V-14B-480P/720P``, ``Wan2.2-TI2V-5B``, and each
  expert folder of ``Wan2.2-{T2V,I2V}-A14B``: ``high_noise_model/``, ``low_noise_model/``): a folder of
  ``diffusion_pytorch_model*.safetensors`` (the 14B ones sharded, with their ``*.index.json``) and a
  ``config.json`` of ``WanModel`` arguments, or a single file, also with ComfyUI's
  ``model.diffusion_model.`` prefix. Without a config the architecture is inferred from the keys.
- diffusers ``WanTransformer3DModel``: ``config.json`` + ``diffusion_pytorch_model*.safetensors``, on its
  own or as the ``transformer/`` folder of a pipeline.

The two are pure renamings of each other, apart from two points the tables below carry:

- The affine LayerNorm before cross-attention is ``norm3`` in the original and ``norm2`` in diffusers
  (each layout's other FFN norm has no parameters). jaxdit calls it ``cross_norm``.
- Parameter shapes jaxdit stores differently from both layouts: the patch embedding is a per-patch
  kernel (:class:`ConvPatchKernel`), and the modulation tables drop their leading unit axis
  (:class:`DropUnitAxis`). Linear weights are transposed as for every model.

:func:`write_original` inverts the original table to write an original-layout checkpoint (sharded, with an
index) from a diffusers state dict; the tests make their original-layout checkpoints that way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from converters.checkpoints import CheckpointFormat
from converters.errors import CheckpointError
from converters.keymap import IDENTITY, TRANSPOSE, Hook, KeyRule, KeyTable, StateDict, invert, resolve
from converters.safetensors_io import (
    CheckpointFiles,
    LazyTensor,
    open_checkpoint,
    transpose,
    write_safetensors,
)
from jaxdit.models.wan import WanConfig, abstract_model

__all__ = [
    "CHECKPOINTS",
    "DIFFUSERS_EXPERT_DIRS",
    "ORIGINAL_EXPERT_DIRS",
    "ORIGINAL_PREFIX",
    "ConvPatchKernel",
    "DropUnitAxis",
    "WanCheckpoint",
    "detect",
    "diffusers_table",
    "diffusers_to_params",
    "is_wan_checkpoint",
    "original_table",
    "write_original",
]

#: ComfyUI-style single files prefix every original key with this.
ORIGINAL_PREFIX = "model.diffusion_model."
DIFFUSERS_CLASS = "WanTransformer3DModel"
ORIGINAL_CLASS = "WanModel"
#: A key only each layout has (the time projection), used to tell them apart.
ORIGINAL_MARKER = "time_projection.1.weight"
DIFFUSERS_MARKER = "condition_embedder.time_proj.weight"


# --------------------------------------------------------------------------------------------------------
# Named hooks
# --------------------------------------------------------------------------------------------------------


class _MergedLeading(LazyTensor):
    """Lazy reshape merging the leading ``n`` axes of ``source`` into one (C-order, like numpy).

    A box reads the source rows it needs over the merged axes (whole, as they are tiny: a patch's
    features or a unit axis) and only the box's range of the remaining axes.
    """

    def __init__(self, source: LazyTensor, n: int) -> None:
        self._source = source
        self._n = n
        self.shape = (math.prod(source.shape[:n]),) + tuple(source.shape[n:])
        self.dtype = source.dtype

    def _read(self, box):
        (lo, hi), rest = box[0], box[1:]
        full = tuple((0, d) for d in self._source.shape[: self._n]) + tuple(rest)
        block = self._source._read(full)
        return np.ascontiguousarray(block.reshape((-1,) + block.shape[self._n :])[lo:hi])

    def __repr__(self) -> str:
        return f"merge_leading({self._source!r}, {self._n})"


@dataclasses.dataclass(frozen=True)
class ConvPatchKernel(Hook):
    """Conv3d weight [E, C, pt, ph, pw] (kernel = stride = patch) as a per-patch kernel [C*pt*ph*pw, E].

    A Conv3d whose kernel equals its stride is one linear map per patch; jaxdit patchifies with features
    in (c, t, h, w) order, which is the weight's own order after moving E last.
    """

    in_channels: int
    patch_size: tuple[int, int, int]
    name: ClassVar[str] = "conv_patch_kernel"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        src = sources[0]
        want = (self.in_channels, *self.patch_size)
        if src.ndim != 5 or tuple(src.shape[1:]) != want:
            raise ValueError(
                f"expects a Conv3d weight [E, {', '.join(map(str, want))}], got {tuple(src.shape)}"
            )
        return _MergedLeading(transpose(src, (1, 2, 3, 4, 0)), 4)

    def invert(self, target: np.ndarray):
        e = target.shape[-1]
        src = target.reshape(self.in_channels, *self.patch_size, e).transpose(4, 0, 1, 2, 3)
        return [(0, tuple((0, d) for d in src.shape), np.ascontiguousarray(src))]


@dataclasses.dataclass(frozen=True)
class DropUnitAxis(Hook):
    """A modulation table stored as [1, n, E] used as [n, E]."""

    name: ClassVar[str] = "drop_unit_axis"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        src = sources[0]
        if src.ndim < 2 or src.shape[0] != 1:
            raise ValueError(f"expects a leading axis of size 1, got {tuple(src.shape)}")
        return _MergedLeading(src, 2)

    def invert(self, target: np.ndarray):
        src = np.asarray(target)[None]
        return [(0, tuple((0, d) for d in src.shape), src)]


DROP_UNIT_AXIS = DropUnitAxis()


# --------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------


def _linear(target: str, source: str, stack: str | None = None) -> list[KeyRule]:
    return [
        KeyRule(f"{target}.kernel", f"{source}.weight", TRANSPOSE, stack),
        KeyRule(f"{target}.bias", f"{source}.bias", IDENTITY, stack),
    ]


def _norm(target: str, source: str, stack: str | None = None, bias: bool = False) -> list[KeyRule]:
    """A norm's scale (and shift): jaxdit keeps them as ``<target>_weight``/``_bias`` or ``<target>``."""
    if not bias:
        return [KeyRule(target, f"{source}.weight", IDENTITY, stack)]
    return [
        KeyRule(f"{target}_weight", f"{source}.weight", IDENTITY, stack),
        KeyRule(f"{target}_bias", f"{source}.bias", IDENTITY, stack),
    ]


def _table(cfg: WanConfig, layout: str, n: Mapping[str, str]) -> KeyTable:
    """The rules shared by both layouts, from a dict of each layout's module names."""
    blk, b = n["block"], "blocks"
    rules = [
        KeyRule(
            "patch_embedding.kernel",
            "patch_embedding.weight",
            ConvPatchKernel(cfg.in_channels, cfg.patch_size),
        )
    ]
    rules.append(KeyRule("patch_embedding.bias", "patch_embedding.bias"))
    rules += _linear("text_embedding_1", n["text_1"]) + _linear("text_embedding_2", n["text_2"])
    rules += _linear("time_embedding_1", n["time_1"]) + _linear("time_embedding_2", n["time_2"])
    rules += _linear("time_projection", n["time_proj"])
    if cfg.is_i2v:
        img = n["image"]
        rules += _norm("image_embedding.norm_in", f"{img}.{n['image_norm_in']}", bias=True)
        rules += _linear("image_embedding.fc1", f"{img}.{n['image_fc1']}")
        rules += _linear("image_embedding.fc2", f"{img}.{n['image_fc2']}")
        rules += _norm("image_embedding.norm_out", f"{img}.{n['image_norm_out']}", bias=True)

    rules.append(KeyRule(f"{b}.modulation", f"{blk}.{n['modulation']}", DROP_UNIT_AXIS, b))
    for attn, src in (("self_attn", n["self_attn"]), ("cross_attn", n["cross_attn"])):
        for part in ("q", "k", "v", "o"):
            rules += _linear(f"{b}.{attn}.{part}", f"{blk}.{src}.{n[part]}", b)
        rules += _norm(f"{b}.{attn}.norm_q", f"{blk}.{src}.norm_q", b)
        rules += _norm(f"{b}.{attn}.norm_k", f"{blk}.{src}.norm_k", b)
    if cfg.is_i2v:
        src = f"{blk}.{n['cross_attn']}"
        rules += _linear(f"{b}.cross_attn.k_img", f"{src}.{n['k_img']}", b)
        rules += _linear(f"{b}.cross_attn.v_img", f"{src}.{n['v_img']}", b)
        rules += _norm(f"{b}.cross_attn.norm_k_img", f"{src}.{n['norm_k_img']}", b)
    rules += _norm(f"{b}.cross_norm", f"{blk}.{n['cross_norm']}", b, bias=True)
    rules += _linear(f"{b}.ffn_in", f"{blk}.{n['ffn_in']}", b) + _linear(
        f"{b}.ffn_out", f"{blk}.{n['ffn_out']}", b
    )

    rules.append(KeyRule("head_modulation", n["head_modulation"], DROP_UNIT_AXIS))
    rules += _linear("head", n["head"])
    return KeyTable(f"Wan {layout}", tuple(rules), {b: cfg.num_layers})


def original_table(cfg: WanConfig) -> KeyTable:
    """Original ``WanModel`` state dict -> jaxdit parameters."""
    names = {
        "block": "blocks.{i}",
        "text_1": "text_embedding.0",
        "text_2": "text_embedding.2",
        "time_1": "time_embedding.0",
        "time_2": "time_embedding.2",
        "time_proj": "time_projection.1",
        "image": "img_emb.proj",
        "image_norm_in": "0",
        "image_fc1": "1",
        "image_fc2": "3",
        "image_norm_out": "4",
        "modulation": "modulation",
        "self_attn": "self_attn",
        "cross_attn": "cross_attn",
        "q": "q",
        "k": "k",
        "v": "v",
        "o": "o",
        "k_img": "k_img",
        "v_img": "v_img",
        "norm_k_img": "norm_k_img",
        "cross_norm": "norm3",  # the affine one; the original's norm2 (FFN) has no parameters
        "ffn_in": "ffn.0",
        "ffn_out": "ffn.2",
        "head_modulation": "head.modulation",
        "head": "head.head",
    }
    return _table(cfg, "original", names)


def diffusers_table(cfg: WanConfig) -> KeyTable:
    """diffusers ``WanTransformer3DModel`` state dict -> jaxdit parameters."""
    names = {
        "block": "blocks.{i}",
        "text_1": "condition_embedder.text_embedder.linear_1",
        "text_2": "condition_embedder.text_embedder.linear_2",
        "time_1": "condition_embedder.time_embedder.linear_1",
        "time_2": "condition_embedder.time_embedder.linear_2",
        "time_proj": "condition_embedder.time_proj",
        "image": "condition_embedder.image_embedder",
        "image_norm_in": "norm1",
        "image_fc1": "ff.net.0.proj",
        "image_fc2": "ff.net.2",
        "image_norm_out": "norm2",
        "modulation": "scale_shift_table",
        "self_attn": "attn1",
        "cross_attn": "attn2",
        "q": "to_q",
        "k": "to_k",
        "v": "to_v",
        "o": "to_out.0",
        "k_img": "add_k_proj",
        "v_img": "add_v_proj",
        "norm_k_img": "norm_added_k",
        "cross_norm": "norm2",  # the affine one; diffusers' norm3 (FFN) has no parameters
        "ffn_in": "ffn.net.0.proj",
        "ffn_out": "ffn.net.2",
        "head_modulation": "scale_shift_table",
        "head": "proj_out",
    }
    return _table(cfg, "diffusers", names)


# --------------------------------------------------------------------------------------------------------
# Layout detection
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class WanCheckpoint:
    """An opened Wan checkpoint: its files, layout, key prefix and model config."""

    files: CheckpointFiles
    layout: str  # "original" or "diffusers"
    prefix: str
    config: WanConfig

    @property
    def table(self) -> KeyTable:
        return original_table(self.config) if self.layout == "original" else diffusers_table(self.config)

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype (of the patch embedding's weight)."""
        return self.files.dtype(self.prefix + "patch_embedding.weight")

    def resolve(self, expected: Mapping[str, tuple[int, ...]]) -> dict[str, LazyTensor]:
        """Lazy target tensors (see :func:`converters.keymap.resolve`)."""
        return resolve(self.table, self.files, expected, prefix=self.prefix)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the config: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: the config is not a JSON object")
    return data


#: Wan 2.2 A14B's expert folders (high noise, low noise) in Wan-AI's releases and in diffusers' pipelines.
ORIGINAL_EXPERT_DIRS = ("high_noise_model", "low_noise_model")
DIFFUSERS_EXPERT_DIRS = ("transformer", "transformer_2")


def _two_experts(path: Path) -> tuple[str, str] | None:
    """The two expert folders' names if ``path`` is a whole Wan 2.2 A14B folder (diffusers' or Wan-AI's)."""
    for high, low in (DIFFUSERS_EXPERT_DIRS, ORIGINAL_EXPERT_DIRS):
        if (path / high).is_dir() and (path / low).is_dir():
            return high, low
    return None


def _config_folder(path: Path) -> tuple[Path, dict[str, Any]] | None:
    """(folder, config) of a Wan transformer folder: ``path`` itself or a pipeline's ``transformer/``."""
    for folder in (path, path / "transformer"):
        file = folder / "config.json"
        if file.is_file():
            data = _read_json(file)
            if data.get("_class_name") in (DIFFUSERS_CLASS, ORIGINAL_CLASS):
                return folder, data
    return None


def _files_name(files: CheckpointFiles) -> str:
    return str(files.index_path or ", ".join(str(f.path) for f in files.files))


def _weights(folder: Path) -> CheckpointFiles:
    """The transformer weights of a folder (which may also hold a VAE or text encoder as .pth files)."""
    indexes = sorted(folder.glob("diffusion_pytorch_model*.safetensors.index.json"))
    if len(indexes) == 1:
        return CheckpointFiles.from_index(indexes[0])
    files = sorted(folder.glob("diffusion_pytorch_model*.safetensors"))
    if not files:
        return open_checkpoint(folder)
    return CheckpointFiles(files)


def is_wan_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` looks like a Wan transformer checkpoint (cheap: config or header keys only)."""
    path = Path(path)
    if path.is_dir():
        if _config_folder(path) is not None or _two_experts(path) is not None:
            return True
        if (path / "config.json").is_file() and not list(path.glob("diffusion_pytorch_model*.safetensors")):
            return False
    try:
        keys = set((_weights(path) if path.is_dir() else open_checkpoint(path)).keys())
    except CheckpointError:
        return False
    return any(p + m in keys for p in ("", ORIGINAL_PREFIX) for m in (ORIGINAL_MARKER, DIFFUSERS_MARKER))


def _diffusers_shapes_to_config(shapes: Mapping[str, tuple[int, ...]]) -> WanConfig:
    """A diffusers-keyed file without its config.json: infer like the original-key inference."""

    def shape(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise KeyError(f"cannot infer the Wan config: no tensor {key!r}")
        return tuple(shapes[key])

    dim, in_channels, *patch = shape("patch_embedding.weight")
    layers = {
        int(k.split(".")[1]) for k in shapes if k.startswith("blocks.") and k.endswith(".scale_shift_table")
    }
    if dim % 128:
        raise ValueError(
            f"dim={dim} is not a multiple of 128: the head count cannot be inferred; pass a config"
        )
    image = "condition_embedder.image_embedder.norm1.weight"
    return WanConfig(
        dim=dim,
        ffn_dim=shape("blocks.0.ffn.net.0.proj.weight")[0],
        num_heads=dim // 128,
        num_layers=len(layers),
        in_channels=in_channels,
        out_channels=shape("proj_out.weight")[0] // math.prod(patch),
        patch_size=tuple(patch),
        text_dim=shape("condition_embedder.text_embedder.linear_1.weight")[1],
        freq_dim=shape("condition_embedder.time_embedder.linear_1.weight")[1],
        image_dim=shape(image)[0] if image in shapes else None,
    )


def detect(
    path: str | os.PathLike[str], config: WanConfig | Mapping[str, Any] | None = None
) -> WanCheckpoint:
    """Open a Wan checkpoint of either layout and work out its config.

    ``path``: an original-layout folder (``config.json`` of ``WanModel`` + ``diffusion_pytorch_model*``
    files, sharded with an index or not), a diffusers transformer or pipeline folder, a single
    ``.safetensors`` file of either layout (original keys may carry ``model.diffusion_model.``), or an
    ``*.index.json``. ``config`` overrides the config read or inferred (a ``WanConfig``, or a diffusers
    config dict); every tensor's shape is still checked against it.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if isinstance(config, Mapping):
        config = WanConfig.from_diffusers(config)
    experts = _two_experts(path)
    if experts is not None:
        high, low = experts
        raise CheckpointError(
            f"{path} holds Wan 2.2's two experts ({high}/ and {low}/), and a checkpoint is one model: name "
            f"{path / high} (high noise) or {path / low} (low noise), or load the whole folder (jaxdit "
            "generate --weights, WanPipeline.from_pretrained / from_checkpoint)"
        )
    found = _config_folder(path) if path.is_dir() else None
    if found is not None:
        folder, data = found
        files = _weights(folder)
        diffusers = data.get("_class_name") == DIFFUSERS_CLASS
        if config is None:
            try:
                config = WanConfig.from_diffusers(data) if diffusers else WanConfig.from_original(data)
            except (KeyError, ValueError) as e:
                raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
            image_key = "img_emb.proj.0.weight"
            if not diffusers and config.condition_channels:
                # The original config records neither the CLIP width (the code hard-codes 1280) nor whether
                # there is a CLIP path at all (Wan 2.1 I2V has one, Wan 2.2 I2V-A14B the same config
                # without it): the keys say.
                image_dim = int(files.shape(image_key)[0]) if image_key in files else None
                config = dataclasses.replace(config, image_dim=image_dim)
        return WanCheckpoint(files, "diffusers" if diffusers else "original", "", config)

    files = _weights(path) if path.is_dir() else open_checkpoint(path)
    keys = set(files.keys())
    for prefix in ("", ORIGINAL_PREFIX):
        for layout, marker in (("original", ORIGINAL_MARKER), ("diffusers", DIFFUSERS_MARKER)):
            if prefix + marker not in keys:
                continue
            if config is None:
                n = len(prefix)
                shapes = {k[n:]: files.shape(k) for k in keys if k.startswith(prefix)}
                try:
                    if layout == "original":
                        config = WanConfig.from_original_keys(shapes)
                    else:
                        config = _diffusers_shapes_to_config(shapes)
                except (KeyError, ValueError) as e:
                    raise CheckpointError(f"{_files_name(files)}: {e.args[0] if e.args else e}") from None
            return WanCheckpoint(files, layout, prefix, config)
    raise CheckpointError(
        f"{_files_name(files)}: not a Wan 2.1 checkpoint (no {ORIGINAL_MARKER!r} or {DIFFUSERS_MARKER!r}; "
        "expected an original Wan-AI folder or a diffusers WanTransformer3DModel folder)"
    )


# --------------------------------------------------------------------------------------------------------
# Export (tests, and anyone who wants original-layout files from diffusers weights)
# --------------------------------------------------------------------------------------------------------


def diffusers_to_params(cfg: WanConfig, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A diffusers state dict (numpy-convertible values) -> jaxdit parameter arrays, by dotted path."""
    from jaxdit.models.wan import parameter_shapes

    lazies = resolve(diffusers_table(cfg), StateDict(state_dict), parameter_shapes(cfg))
    return {path: np.asarray(t) for path, t in lazies.items()}


def write_original(
    cfg: WanConfig,
    state_dict: Mapping[str, Any],
    folder: str | os.PathLike[str],
    *,
    shards: int = 1,
    prefix: str = "",
    config_json: bool = True,
    model_type: str | None = None,
) -> Path:
    """Write a diffusers state dict as an original-layout Wan folder, through the inverted original table.

    ``shards`` > 1 splits the tensors over ``diffusion_pytorch_model-0000i-of-0000n.safetensors`` files
    with a ``diffusion_pytorch_model.safetensors.index.json`` (as the 14B repositories are); each file and
    the index are written atomically. ``config_json`` adds the original ``config.json`` (``model_type``:
    see :func:`original_config_json`). Returns the folder.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = invert(original_table(cfg), diffusers_to_params(cfg, state_dict), prefix=prefix)
    if shards <= 1:
        write_safetensors(folder / "diffusion_pytorch_model.safetensors", tensors)
    else:
        names = sorted(tensors)
        parts = np.array_split(np.arange(len(names)), shards)
        weight_map: dict[str, str] = {}
        for i, part in enumerate(parts):
            file = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(folder / file, {names[j]: tensors[names[j]] for j in part})
            weight_map.update({names[j]: file for j in part})
        total = sum(int(np.asarray(t).nbytes) for t in tensors.values())
        _write_text(
            folder / "diffusion_pytorch_model.safetensors.index.json",
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2),
        )
    if config_json:
        _write_text(folder / "config.json", json.dumps(original_config_json(cfg, model_type), indent=2))
    return folder


def original_model_type(cfg: WanConfig) -> str:
    """``model_type`` of the original ``config.json``: ``i2v`` for the condition-channel models (Wan 2.1
    I2V and Wan 2.2 I2V-A14B), ``ti2v`` for a 48-channel (Wan 2.2 VAE) model, else ``t2v``."""
    if cfg.condition_channels or cfg.is_i2v:
        return "i2v"
    return "ti2v" if cfg.out_channels == 48 else "t2v"


def original_config_json(cfg: WanConfig, model_type: str | None = None) -> dict[str, Any]:
    """The original repositories' ``config.json`` for ``cfg`` (``model_type`` overrides
    :func:`original_model_type`). An ``i2v`` model without Wan 2.1's CLIP path (Wan 2.2 I2V-A14B) gets
    ``"image_dim": null``, which the originals do not write (their keys tell), so that the file alone
    reads back as ``cfg``."""
    model_type = model_type or original_model_type(cfg)
    extra = {"image_dim": None} if model_type == "i2v" and not cfg.is_i2v else {}
    return {
        "_class_name": ORIGINAL_CLASS,
        "model_type": model_type,
        "dim": cfg.dim,
        "ffn_dim": cfg.ffn_dim,
        "num_heads": cfg.num_heads,
        "num_layers": cfg.num_layers,
        "in_dim": cfg.in_channels,
        "out_dim": cfg.out_channels,
        "patch_size": list(cfg.patch_size),
        "text_dim": cfg.text_dim,
        "freq_dim": cfg.freq_dim,
        "eps": cfg.eps,
        "text_len": 512,
        **extra,
    }


def _write_text(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


#: Wan checkpoints as ``jaxdit.loading`` reads them (original, diffusers, or a ``jaxdit convert`` folder).
CHECKPOINTS = CheckpointFormat(
    name="wan",
    detect=is_wan_checkpoint,
    open=detect,
    config_class=WanConfig,
    abstract_model=abstract_model,
)
