"""AutoencoderKL (FLUX's AE) checkpoints -> jaxdit parameters: diffusers and BFL key tables, detection.

Layouts (diffusers' ``models/autoencoders/autoencoder_kl.py`` and BFL's ``src/flux/modules/autoencoder.py``):

- diffusers ``AutoencoderKL`` folder: ``config.json`` + ``diffusion_pytorch_model.safetensors``, on its
  own or as the ``vae/`` folder of a pipeline. ``down_blocks.i.resnets.j``, ``downsamplers.0.conv``,
  ``mid_block.resnets.{0,1}`` / ``mid_block.attentions.0`` (``group_norm``, ``to_q/k/v``, ``to_out.0`` as
  Linear [out, in]), ``up_blocks.k`` in decoding order, ``conv_norm_out``, optional ``quant_conv`` /
  ``post_quant_conv``.
- BFL ``ae.safetensors`` (``src/flux/modules/autoencoder.py``): ``encoder.down.i.block.j`` with
  ``nin_shortcut``, ``downsample.conv``, ``mid.block_1`` / ``mid.attn_1`` (``norm``, ``q``, ``k``, ``v``,
  ``proj_out`` as 1x1 Conv2d [out, in, 1, 1]) / ``mid.block_2``, ``norm_out``; the decoder's ``up.i`` is
  indexed by resolution level, so decoding-order level k is ``up.(levels - 1 - k)``. The config is
  inferred from the shapes (GroupNorm's group count cannot be: 32 unless a config says otherwise).

jaxdit's parameters (``jaxdit/vae/autoencoder_kl.py``) keep convolution kernels HWIO and projections
[in, out]. Named hooks: :data:`CONV` (OIHW -> HWIO), ``TRANSPOSE`` (Linear), :data:`CONV1X1_DENSE`
(BFL's 1x1 conv -> [in, out]). :func:`write_bfl` inverts the BFL table (tests write BFL files that way).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from converters.errors import CheckpointError
from converters.keymap import (
    IDENTITY,
    TRANSPOSE,
    Hook,
    KeyRule,
    KeyTable,
    StateDict,
    invert,
    resolve,
)
from converters.safetensors_io import (
    CheckpointFiles,
    LazyTensor,
    open_checkpoint,
    transpose,
    write_safetensors,
)
from jaxdit.vae.autoencoder_kl import VAEConfig

__all__ = [
    "CONV",
    "CONV1X1_DENSE",
    "VAECheckpoint",
    "bfl_table",
    "detect",
    "diffusers_table",
    "diffusers_to_params",
    "infer_config",
    "write_bfl",
]

DIFFUSERS_CLASS = "AutoencoderKL"
_BFL_PROBE = "encoder.down.0.block.0.conv1.weight"
_DIFFUSERS_PROBE = "encoder.down_blocks.0.resnets.0.conv1.weight"


# --------------------------------------------------------------------------------------------------------
# Named hooks
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvKernel(Hook):
    """A torch ``Conv2d`` weight [out, in, kh, kw] as an HWIO kernel [kh, kw, in, out]."""

    name: ClassVar[str] = "conv_kernel"

    def apply(self, sources):
        src = sources[0]
        if src.ndim != 4:
            raise ValueError(f"a conv weight has 4 dims [out, in, kh, kw], got shape {tuple(src.shape)}")
        return transpose(src, (2, 3, 1, 0))

    def invert(self, target):
        src = np.ascontiguousarray(np.transpose(target, (3, 2, 0, 1)))
        return [(0, tuple((0, d) for d in src.shape), src)]


class _Squeezed(LazyTensor):
    """[out, in, 1, 1] -> [out, in], lazily."""

    def __init__(self, source: LazyTensor) -> None:
        self._source = source
        self.shape = tuple(source.shape[:2])
        self.dtype = source.dtype

    def _read(self, box):
        return self._source._read(tuple(box) + ((0, 1), (0, 1)))[..., 0, 0]

    def __repr__(self) -> str:
        return f"squeeze({self._source!r})"


@dataclasses.dataclass(frozen=True)
class Conv1x1Dense(Hook):
    """BFL's attention projections, 1x1 ``Conv2d`` weights [out, in, 1, 1], as kernels [in, out]."""

    name: ClassVar[str] = "conv1x1_dense"

    def apply(self, sources):
        src = sources[0]
        if src.ndim != 4 or tuple(src.shape[2:]) != (1, 1):
            raise ValueError(f"expected a 1x1 conv weight [out, in, 1, 1], got shape {tuple(src.shape)}")
        return transpose(_Squeezed(src), (1, 0))

    def invert(self, target):
        src = np.ascontiguousarray(target.T)[:, :, None, None]
        return [(0, tuple((0, d) for d in src.shape), src)]


CONV = ConvKernel()
CONV1X1_DENSE = Conv1x1Dense()


# --------------------------------------------------------------------------------------------------------
# Tables: both layouts from one description of the model, so they cannot drift apart
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Names:
    down: str  # "{i}" level of the encoder
    down_res: str
    downsample: str
    up: str  # "{i}" decoding-order level; BFL's table renumbers
    up_res: str
    upsample: str
    mid_res: tuple[str, str]
    attn: str
    attn_parts: tuple[str, str, str, str, str]  # norm, q, k, v, proj
    attn_hook: Hook
    shortcut: str
    norm_out: str


_DIFFUSERS = _Names(
    down="down_blocks.{i}",
    down_res="resnets",
    downsample="downsamplers.0.conv",
    up="up_blocks.{i}",
    up_res="resnets",
    upsample="upsamplers.0.conv",
    mid_res=("mid_block.resnets.0", "mid_block.resnets.1"),
    attn="mid_block.attentions.0",
    attn_parts=("group_norm", "to_q", "to_k", "to_v", "to_out.0"),
    attn_hook=TRANSPOSE,
    shortcut="conv_shortcut",
    norm_out="conv_norm_out",
)
_BFL = _Names(
    down="down.{i}",
    down_res="block",
    downsample="downsample.conv",
    up="up.{i}",
    up_res="block",
    upsample="upsample.conv",
    mid_res=("mid.block_1", "mid.block_2"),
    attn="mid.attn_1",
    attn_parts=("norm", "q", "k", "v", "proj_out"),
    attn_hook=CONV1X1_DENSE,
    shortcut="nin_shortcut",
    norm_out="norm_out",
)


def _conv(target: str, source: str) -> list[KeyRule]:
    return [
        KeyRule(f"{target}.kernel", f"{source}.weight", CONV),
        KeyRule(f"{target}.bias", f"{source}.bias"),
    ]


def _norm(target: str, source: str) -> list[KeyRule]:
    return [KeyRule(f"{target}.scale", f"{source}.weight"), KeyRule(f"{target}.bias", f"{source}.bias")]


def _res(target: str, source: str, names: _Names, c_in: int, c_out: int) -> list[KeyRule]:
    rules = _norm(f"{target}.norm1", f"{source}.norm1") + _conv(f"{target}.conv1", f"{source}.conv1")
    rules += _norm(f"{target}.norm2", f"{source}.norm2") + _conv(f"{target}.conv2", f"{source}.conv2")
    if c_in != c_out:
        rules += _conv(f"{target}.shortcut", f"{source}.{names.shortcut}")
    return rules


def _mid(target: str, source: str, names: _Names, c: int, cfg: VAEConfig) -> list[KeyRule]:
    rules = _res(f"{target}.res1", f"{source}.{names.mid_res[0]}", names, c, c)
    if cfg.mid_block_add_attention:
        a, src = f"{target}.attn", f"{source}.{names.attn}"
        norm, *proj = names.attn_parts
        rules += _norm(f"{a}.norm", f"{src}.{norm}")
        for t, s in zip(("q", "k", "v", "proj"), proj, strict=True):
            rules += [
                KeyRule(f"{a}.{t}.kernel", f"{src}.{s}.weight", names.attn_hook),
                KeyRule(f"{a}.{t}.bias", f"{src}.{s}.bias", IDENTITY),
            ]
    return rules + _res(f"{target}.res2", f"{source}.{names.mid_res[1]}", names, c, c)


def _table(name: str, cfg: VAEConfig, names: _Names, bfl: bool) -> KeyTable:
    ch, n = cfg.block_out_channels, cfg.levels
    rules = _conv("encoder.conv_in", "encoder.conv_in")
    for i, c in enumerate(ch):
        src = "encoder." + names.down.format(i=i)
        for j in range(cfg.layers_per_block):
            c_in = ch[max(i - 1, 0)] if j == 0 else c
            rules += _res(f"encoder.down.{i}.res.{j}", f"{src}.{names.down_res}.{j}", names, c_in, c)
        if i < n - 1:
            rules += _conv(f"encoder.down.{i}.resample", f"{src}.{names.downsample}")
    rules += _mid("encoder.mid", "encoder", names, ch[-1], cfg)
    rules += _norm("encoder.norm_out", f"encoder.{names.norm_out}")
    rules += _conv("encoder.conv_out", "encoder.conv_out")

    rch = tuple(reversed(ch))
    rules += _conv("decoder.conv_in", "decoder.conv_in")
    rules += _mid("decoder.mid", "decoder", names, rch[0], cfg)
    for k, c in enumerate(rch):
        src = "decoder." + names.up.format(i=n - 1 - k if bfl else k)
        for j in range(cfg.layers_per_block + 1):
            c_in = rch[max(k - 1, 0)] if j == 0 else c
            rules += _res(f"decoder.up.{k}.res.{j}", f"{src}.{names.up_res}.{j}", names, c_in, c)
        if k < n - 1:
            rules += _conv(f"decoder.up.{k}.resample", f"{src}.{names.upsample}")
    rules += _norm("decoder.norm_out", f"decoder.{names.norm_out}")
    rules += _conv("decoder.conv_out", "decoder.conv_out")
    if cfg.use_quant_conv:
        rules += _conv("quant_conv", "quant_conv")
    if cfg.use_post_quant_conv:
        rules += _conv("post_quant_conv", "post_quant_conv")
    return KeyTable(name, tuple(rules))


def diffusers_table(cfg: VAEConfig) -> KeyTable:
    """diffusers ``AutoencoderKL`` state dict -> jaxdit parameters."""
    return _table("AutoencoderKL diffusers", cfg, _DIFFUSERS, bfl=False)


def bfl_table(cfg: VAEConfig) -> KeyTable:
    """BFL ``AutoEncoder`` state dict (``ae.safetensors``) -> jaxdit parameters."""
    return _table("AutoencoderKL BFL", cfg, _BFL, bfl=True)


# --------------------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class VAECheckpoint:
    """An opened AutoencoderKL checkpoint: files, layout ("diffusers" or "bfl") and config."""

    files: CheckpointFiles
    layout: str
    config: VAEConfig

    @property
    def table(self) -> KeyTable:
        return bfl_table(self.config) if self.layout == "bfl" else diffusers_table(self.config)

    @property
    def dtype(self) -> np.dtype:
        return self.files.dtype("decoder.conv_in.weight")

    def resolve(self, expected: Mapping[str, tuple[int, ...]]):
        """Lazy target tensors (see :func:`converters.keymap.resolve`)."""
        return resolve(self.table, self.files, expected)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the config: {e}") from e


def _diffusers_folder(path: Path) -> Path | None:
    for folder in (path, path / "vae"):
        cfg = folder / "config.json"
        if cfg.is_file() and _read_config(cfg).get("_class_name") == DIFFUSERS_CLASS:
            return folder
    return None


def _open_folder(folder: Path) -> CheckpointFiles:
    """The fp32 ``diffusion_pytorch_model.safetensors`` when present (folders may also hold variants)."""
    main = folder / "diffusion_pytorch_model.safetensors"
    return open_checkpoint(main if main.is_file() else folder)


def infer_config(files: CheckpointFiles, layout: str, norm_num_groups: int = 32) -> VAEConfig:
    """Channels, levels, blocks, quant convs and mid attention from the shapes of a ``layout`` checkpoint.

    GroupNorm's group count leaves no trace in the weights: BFL's AE hard-codes 32, which is the default.
    """
    keys = set(files.keys())
    down = "encoder.down.{i}.block" if layout == "bfl" else "encoder.down_blocks.{i}.resnets"
    ch = []
    while f"{down.format(i=len(ch))}.0.conv1.weight" in keys:
        ch.append(files.shape(f"{down.format(i=len(ch))}.0.conv1.weight")[0])
    per_level = 0
    while f"{down.format(i=0)}.{per_level}.conv1.weight" in keys:
        per_level += 1
    attn = "encoder.mid.attn_1.q.weight" if layout == "bfl" else "encoder.mid_block.attentions.0.to_q.weight"
    return VAEConfig(
        in_channels=files.shape("encoder.conv_in.weight")[1],
        out_channels=files.shape("decoder.conv_out.weight")[0],
        block_out_channels=tuple(ch),
        layers_per_block=per_level,
        latent_channels=files.shape("decoder.conv_in.weight")[1],
        use_quant_conv="quant_conv.weight" in keys,
        use_post_quant_conv="post_quant_conv.weight" in keys,
        mid_block_add_attention=attn in keys,
        norm_num_groups=norm_num_groups,
    )


def detect(
    path: str | os.PathLike[str], config: VAEConfig | Mapping[str, Any] | None = None
) -> VAECheckpoint:
    """Open an AutoencoderKL checkpoint of either layout and work out its config.

    ``path``: a diffusers ``vae/`` folder (or a pipeline folder holding ``vae/``), or one ``.safetensors``
    file in the BFL (``ae.safetensors``) or diffusers key layout. ``config`` overrides the read/inferred
    config (a ``VAEConfig`` or a diffusers config dict); every tensor is still checked against it.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if isinstance(config, Mapping):
        config = VAEConfig.from_diffusers(config)
    if path.is_dir():
        folder = _diffusers_folder(path)
        if folder is None:
            raise CheckpointError(
                f"{path}: not a diffusers AutoencoderKL folder (no config.json with _class_name "
                f"'{DIFFUSERS_CLASS}' here or in vae/)"
            )
        files = _open_folder(folder)
        try:
            cfg = config or VAEConfig.from_diffusers(_read_config(folder / "config.json"))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
        return VAECheckpoint(files, "diffusers", cfg)
    files = open_checkpoint(path)
    keys = set(files.keys())
    for layout, probe in (("bfl", _BFL_PROBE), ("diffusers", _DIFFUSERS_PROBE)):
        if probe in keys:
            try:
                cfg = config or infer_config(files, layout)
            except (KeyError, ValueError) as e:
                raise CheckpointError(
                    f"{path}: cannot infer the AutoencoderKL config ({e}); pass config= (a VAEConfig or a "
                    "diffusers config dict)"
                ) from None
            return VAECheckpoint(files, layout, cfg)
    raise CheckpointError(
        f"{path}: not an AutoencoderKL checkpoint (no {_BFL_PROBE!r} or {_DIFFUSERS_PROBE!r}; expected "
        "BFL's ae.safetensors or a diffusers AutoencoderKL)"
    )


# --------------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------------


def diffusers_to_params(cfg: VAEConfig, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A diffusers state dict (numpy-convertible values) -> jaxdit parameter arrays, by path."""
    from jaxdit.vae.autoencoder_kl import parameter_shapes

    lazies = resolve(diffusers_table(cfg), StateDict(state_dict), parameter_shapes(cfg))
    return {p: np.asarray(t) for p, t in lazies.items()}


def write_bfl(cfg: VAEConfig, state_dict: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a diffusers AutoencoderKL state dict as a BFL ``ae.safetensors`` (atomically)."""
    return write_safetensors(path, invert(bfl_table(cfg), diffusers_to_params(cfg, state_dict)))
