"""Wan VAE (2.1 and 2.2) checkpoints -> jaxdit parameters: diffusers and original key tables, detection.

Layouts:

- diffusers ``AutoencoderKLWan``: ``vae/config.json`` + ``vae/diffusion_pytorch_model.safetensors``.
- Wan's original ``Wan2.1_VAE.pth`` (``WanVAE_`` of ``wan/modules/vae.py``) and ``Wan2.2_VAE.pth``
  (``WanVAE_`` of ``wan/modules/vae2_2.py``), torch zip archives read only through
  ``torch.load(..., weights_only=True, mmap=True)`` (no arbitrary unpickling), or the same keys in a
  ``.safetensors`` (as ComfyUI ships them).

The two are renamings of each other (diffusers renames one into the other in
``scripts/convert_wan_to_diffusers.py`` (``convert_vae``, ``convert_vae_22``) and
``loaders/single_file_utils.convert_wan_vae_to_diffusers``; the tests check the Wan 2.1 table against the
latter at full size): the original keeps the residual blocks as ``residual.{0,2,3,6}`` of an
``nn.Sequential`` (norm, SiLU, conv, norm, SiLU, dropout, conv), the mid-block as ``middle.{0,1,2}``, the
output as ``head.{0,2}``, and the quant convs as ``conv1``/``conv2``. Wan 2.1's encoder and decoder are
flat lists (``downsamples.{k}``, ``upsamples.{k}``: residual blocks, attention blocks, resamplers);
Wan 2.2's are one block per level whose residual blocks and resampler form an inner list
(``downsamples.{i}.downsamples.{j}``, ``upsamples.{i}.upsamples.{j}``; diffusers:
``down_blocks.{i}.resnets.{j}`` + ``.downsampler``, ``up_blocks.{i}.resnets.{j}`` + ``.upsampler``). The
avg-down / dup-up shortcuts have no parameters.
jaxdit stores convolution kernels channels last ([kt, kh, kw, I, O], hook :class:`ConvKernel`) and the
RMS_norm gammas ``[C, 1, 1(, 1)]`` as ``[C]`` (hook :class:`NormScale`).

:func:`write_original_pth` inverts the original table and writes a ``.pth`` with ``torch.save``; the tests
make their original-layout files that way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from converters.errors import CheckpointError
from converters.keymap import Hook, KeyRule, KeyTable, StateDict, invert, resolve
from converters.pth_io import read_pth, torch_module
from converters.safetensors_io import LazyTensor, open_checkpoint, transpose
from jaxdit.vae.wan_vae import WanVAEConfig, parameter_shapes

__all__ = [
    "ConvKernel",
    "NormScale",
    "WanVAECheckpoint",
    "as_wan_config",
    "detect",
    "diffusers_table",
    "diffusers_to_params",
    "original_table",
    "read_pth",
    "write_original_pth",
]

DIFFUSERS_CLASS = "AutoencoderKLWan"
#: diffusers classes with this state dict. ``AutoencoderKLQwenImage`` is the Wan 2.1 VAE as Qwen-Image
#: ships it (same modules and keys, run on single frames), its channel count named ``input_channels``.
DIFFUSERS_CLASSES = (DIFFUSERS_CLASS, "AutoencoderKLQwenImage")
#: A key only each layout has.
ORIGINAL_MARKER = "decoder.conv1.weight"
DIFFUSERS_MARKER = "decoder.conv_in.weight"
#: A key only the residual (Wan 2.2) VAE has, per layout.
RESIDUAL_MARKERS = {
    "original": "encoder.downsamples.0.downsamples.0.residual.0.gamma",
    "diffusers": "encoder.down_blocks.0.resnets.0.norm1.gamma",
}
ORIGINAL_FILES = ("Wan2.1_VAE.pth", "Wan2.2_VAE.pth")
ORIGINAL_FILE = ORIGINAL_FILES[0]


# --------------------------------------------------------------------------------------------------------
# Named hooks
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvKernel(Hook):
    """A torch conv weight [O, I, *k] as a channels-last kernel [*k, I, O] (``spatial`` = len(k))."""

    spatial: int
    name: ClassVar[str] = "conv_kernel"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        src = sources[0]
        if src.ndim != self.spatial + 2:
            raise ValueError(f"expects a {self.spatial}-D conv weight [O, I, *k], got {tuple(src.shape)}")
        return transpose(src, (*range(2, self.spatial + 2), 1, 0))

    def invert(self, target: np.ndarray):
        n = self.spatial
        src = np.ascontiguousarray(np.transpose(target, (n + 1, n, *range(n))))
        return [(0, tuple((0, d) for d in src.shape), src)]


class _TrailingUnits(LazyTensor):
    """Lazy ``source.reshape(source.shape[:-units])`` for trailing axes of size 1."""

    def __init__(self, source: LazyTensor, units: int) -> None:
        self._source = source
        self._units = units
        self.shape = tuple(source.shape[: source.ndim - units])
        self.dtype = source.dtype

    def _read(self, box):
        block = self._source._read(tuple(box) + ((0, 1),) * self._units)
        return block.reshape(block.shape[: block.ndim - self._units])

    def __repr__(self) -> str:
        return f"drop_trailing_units({self._source!r}, {self._units})"


@dataclasses.dataclass(frozen=True)
class NormScale(Hook):
    """An RMS_norm gamma [C, 1, 1] (images) or [C, 1, 1, 1] (video) as a scale [C]."""

    units: int
    name: ClassVar[str] = "norm_scale"

    def apply(self, sources: Sequence[LazyTensor]) -> LazyTensor:
        src = sources[0]
        if src.ndim != 1 + self.units or any(d != 1 for d in src.shape[1:]):
            raise ValueError(f"expects a gamma [C{', 1' * self.units}], got {tuple(src.shape)}")
        return _TrailingUnits(src, self.units)

    def invert(self, target: np.ndarray):
        src = np.asarray(target).reshape(target.shape + (1,) * self.units)
        return [(0, tuple((0, d) for d in src.shape), src)]


CONV3D, CONV2D = ConvKernel(3), ConvKernel(2)
VIDEO_NORM, IMAGE_NORM = NormScale(3), NormScale(2)


# --------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------


def _conv(target: str, source: str, hook: Hook = CONV3D) -> list[KeyRule]:
    return [
        KeyRule(f"{target}.kernel", f"{source}.weight", hook),
        KeyRule(f"{target}.bias", f"{source}.bias"),
    ]


@dataclasses.dataclass(frozen=True)
class _Names:
    """How one layout names the parts of a block (everything else is the same module tree)."""

    res: Callable[[str], dict[str, str]]  # block prefix -> {norm1, conv1, norm2, conv2, shortcut}
    mid: tuple[str, str, str]  # res0, attn, res1
    conv_in: str
    head: tuple[str, str]  # norm, conv
    quant: tuple[str, str]  # quant conv, post-quant conv
    encoder_down: str  # Wan 2.1: the flat list
    decoder_up: Callable[[int, int | None], str]  # (level, resnet j or None for the upsampler) -> prefix
    encoder_level: Callable[[int, int | None], str]  # Wan 2.2: (level, resnet j or None: downsampler)


def _resblock(target: str, source: str, c_in: int, c_out: int, names: _Names) -> list[KeyRule]:
    n = names.res(source)
    rules = [KeyRule(f"{target}.norm1.scale", f"{n['norm1']}.gamma", VIDEO_NORM)]
    rules += _conv(f"{target}.conv1", n["conv1"])
    rules += [KeyRule(f"{target}.norm2.scale", f"{n['norm2']}.gamma", VIDEO_NORM)]
    rules += _conv(f"{target}.conv2", n["conv2"])
    if c_in != c_out:
        rules += _conv(f"{target}.shortcut", n["shortcut"])
    return rules


def _attention(target: str, source: str) -> list[KeyRule]:
    rules = [KeyRule(f"{target}.norm.scale", f"{source}.norm.gamma", IMAGE_NORM)]
    return (
        rules
        + _conv(f"{target}.qkv", f"{source}.to_qkv", CONV2D)
        + _conv(f"{target}.proj", f"{source}.proj", CONV2D)
    )


def _mid(target: str, source: str, dim: int, names: _Names) -> list[KeyRule]:
    res0, attn, res1 = (f"{source}.{m}" for m in names.mid)
    rules = _resblock(f"{target}.res0", res0, dim, dim, names)
    rules += _attention(f"{target}.attn", attn)
    return rules + _resblock(f"{target}.res1", res1, dim, dim, names)


def _resample(target: str, source: str, mode: str) -> list[KeyRule]:
    rules = _conv(f"{target}.conv", f"{source}.resample.1", CONV2D)
    if mode.endswith("3d"):
        rules += _conv(f"{target}.time_conv", f"{source}.time_conv")
    return rules


def _table(cfg: WanVAEConfig, layout: str, names: _Names) -> KeyTable:
    rules: list[KeyRule] = []
    levels = len(cfg.dim_mult)

    # Encoder. Wan 2.1: one flat list of residual blocks, attention blocks (attn_scales) and resamplers
    # in both layouts and in jaxdit. Wan 2.2: one block per level (residual blocks, then a resampler).
    dims = cfg.encoder_dims()
    rules += _conv("encoder.conv_in", f"encoder.{names.conv_in}")
    k, scale = 0, 1.0
    for i, (c_in, c_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        if cfg.is_residual:
            for j in range(cfg.num_res_blocks):
                target = f"encoder.down.{i}.resnets.{j}"
                rules += _resblock(target, names.encoder_level(i, j), c_in, c_out, names)
                c_in = c_out
            ft, fs = cfg.down_factors(i)
            if fs > 1:
                mode = "downsample3d" if ft > 1 else "downsample2d"
                rules += _resample(f"encoder.down.{i}.downsample", names.encoder_level(i, None), mode)
            continue
        for _ in range(cfg.num_res_blocks):
            rules += _resblock(f"encoder.down.{k}", f"encoder.{names.encoder_down}.{k}", c_in, c_out, names)
            c_in, k = c_out, k + 1
            if scale in cfg.attn_scales:
                rules += _attention(f"encoder.down.{k}", f"encoder.{names.encoder_down}.{k}")
                k += 1
        if i != levels - 1:
            mode = "downsample3d" if cfg.encoder_temporal[i] else "downsample2d"
            rules += _resample(f"encoder.down.{k}", f"encoder.{names.encoder_down}.{k}", mode)
            k, scale = k + 1, scale / 2
    rules += _mid("encoder.mid", "encoder", dims[-1], names)
    rules.append(KeyRule("encoder.norm_out.scale", f"encoder.{names.head[0]}.gamma", VIDEO_NORM))
    rules += _conv("encoder.conv_out", f"encoder.{names.head[1]}")

    rules += _conv("quant_conv", names.quant[0]) + _conv("post_quant_conv", names.quant[1])

    # Decoder: levels of num_res_blocks + 1 residual blocks, then an upsampler (all but the last).
    dims = cfg.decoder_dims()
    temporal_up = cfg.decoder_temporal
    rules += _conv("decoder.conv_in", f"decoder.{names.conv_in}")
    rules += _mid("decoder.mid", "decoder", dims[0], names)
    for i, (c_in, c_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        c_in = c_in // 2 if i > 0 and not cfg.is_residual else c_in
        for j in range(cfg.num_res_blocks + 1):
            rules += _resblock(f"decoder.up.{i}.resnets.{j}", names.decoder_up(i, j), c_in, c_out, names)
            c_in = c_out
        if i != levels - 1:
            mode = "upsample3d" if temporal_up[i] else "upsample2d"
            rules += _resample(f"decoder.up.{i}.upsample", names.decoder_up(i, None), mode)
    rules.append(KeyRule("decoder.norm_out.scale", f"decoder.{names.head[0]}.gamma", VIDEO_NORM))
    rules += _conv("decoder.conv_out", f"decoder.{names.head[1]}")
    return KeyTable(f"Wan VAE {layout}", tuple(rules))


def diffusers_table(cfg: WanVAEConfig) -> KeyTable:
    """diffusers ``AutoencoderKLWan`` state dict -> jaxdit parameters."""

    def up(i: int, j: int | None) -> str:
        upsampler = "upsampler" if cfg.is_residual else "upsamplers.0"
        return f"decoder.up_blocks.{i}." + (f"resnets.{j}" if j is not None else upsampler)

    def level(i: int, j: int | None) -> str:
        return f"encoder.down_blocks.{i}." + (f"resnets.{j}" if j is not None else "downsampler")

    names = _Names(
        res=lambda p: {
            "norm1": f"{p}.norm1",
            "conv1": f"{p}.conv1",
            "norm2": f"{p}.norm2",
            "conv2": f"{p}.conv2",
            "shortcut": f"{p}.conv_shortcut",
        },
        mid=("mid_block.resnets.0", "mid_block.attentions.0", "mid_block.resnets.1"),
        conv_in="conv_in",
        head=("norm_out", "conv_out"),
        quant=("quant_conv", "post_quant_conv"),
        encoder_down="down_blocks",
        decoder_up=up,
        encoder_level=level,
    )
    return _table(cfg, "diffusers", names)


def original_table(cfg: WanVAEConfig) -> KeyTable:
    """Wan's original ``WanVAE_`` state dict (``Wan2.1_VAE.pth``, ``Wan2.2_VAE.pth``) -> jaxdit parameters."""
    if cfg.attn_scales and not cfg.is_residual:
        raise ValueError(
            f"attn_scales={cfg.attn_scales}: Wan's original code also puts attention blocks in the decoder "
            "at those scales, which diffusers' AutoencoderKLWan (and jaxdit) leaves out; no released "
            "original-layout VAE has them"
        )
    per_level = cfg.num_res_blocks + 2  # residual blocks, then the upsampler

    def up(i: int, j: int | None) -> str:
        index = j if j is not None else cfg.num_res_blocks + 1
        if cfg.is_residual:
            return f"decoder.upsamples.{i}.upsamples.{index}"
        return f"decoder.upsamples.{i * per_level + index}"

    def level(i: int, j: int | None) -> str:
        return f"encoder.downsamples.{i}.downsamples.{j if j is not None else cfg.num_res_blocks}"

    names = _Names(
        # nn.Sequential(RMS_norm, SiLU, conv, RMS_norm, SiLU, Dropout, conv): parameters at 0, 2, 3, 6.
        res=lambda p: {
            "norm1": f"{p}.residual.0",
            "conv1": f"{p}.residual.2",
            "norm2": f"{p}.residual.3",
            "conv2": f"{p}.residual.6",
            "shortcut": f"{p}.shortcut",
        },
        mid=("middle.0", "middle.1", "middle.2"),
        conv_in="conv1",
        head=("head.0", "head.2"),
        quant=("conv1", "conv2"),
        encoder_down="downsamples",
        decoder_up=up,
        encoder_level=level,
    )
    return _table(cfg, "original", names)


# --------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class WanVAECheckpoint:
    """An opened Wan VAE checkpoint: its tensors, layout and config."""

    files: Any  # CheckpointFiles or StateDict
    layout: str  # "original" or "diffusers"
    config: WanVAEConfig
    where: str

    @property
    def table(self) -> KeyTable:
        return original_table(self.config) if self.layout == "original" else diffusers_table(self.config)

    @property
    def dtype(self) -> np.dtype:
        key = ORIGINAL_MARKER if self.layout == "original" else DIFFUSERS_MARKER
        return np.dtype(self.files.tensor(key).dtype)

    def resolve(self, expected: Mapping[str, tuple[int, ...]]) -> dict[str, LazyTensor]:
        return resolve(self.table, self.files, expected)


def _is_vae_config(file: Path) -> bool:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read the config: {e}") from None
    return isinstance(data, dict) and data.get("_class_name") in DIFFUSERS_CLASSES


def as_wan_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers VAE config of any class in :data:`DIFFUSERS_CLASSES` as ``AutoencoderKLWan``'s."""
    if data.get("_class_name") != "AutoencoderKLQwenImage":
        return dict(data)
    channels = data.get("input_channels") or 3
    out = {k: v for k, v in data.items() if k != "input_channels"}
    return {**out, "_class_name": DIFFUSERS_CLASS, "in_channels": channels, "out_channels": channels}


def _find(path: Path) -> tuple[Path, Path | None]:
    """(weights file or folder, diffusers config.json or None) for any accepted ``path``.

    A folder is a diffusers ``vae/`` folder (its config.json names ``AutoencoderKLWan``), a pipeline
    folder holding one in ``vae/``, or a folder holding ``Wan2.1_VAE.pth`` or ``Wan2.2_VAE.pth`` (Wan's
    original releases, whose other ``.pth`` files are the text and image encoders).
    """
    if path.is_file():
        config = path.parent / "config.json"
        is_vae = path.suffix == ".safetensors" and config.is_file() and _is_vae_config(config)
        return path, config if is_vae else None
    for folder in (path, path / "vae"):
        config = folder / "config.json"
        if config.is_file() and _is_vae_config(config):
            return folder, config
    candidates = [path / f for f in ORIGINAL_FILES]
    candidates += sorted(p for p in path.glob("*.pth") if "vae" in p.name.lower())
    for candidate in candidates:
        if candidate.is_file():
            return candidate, None
    raise CheckpointError(
        f"{path}: no Wan VAE here (expected a diffusers vae/ folder whose config.json names "
        f"{DIFFUSERS_CLASS}, or {' / '.join(ORIGINAL_FILES)})"
    )


def _infer_config(files: Any, layout: str, where: str) -> WanVAEConfig:
    """A file without a config: the preset of its generation (Wan 2.2 if it has the residual blocks),
    with the encoder and decoder widths, z_dim and channels read from the tensors; latent statistics
    of the preset when z_dim is the preset's, else zero mean and unit std."""
    original = layout == "original"
    conv_in = "encoder.conv1.weight" if original else "encoder.conv_in.weight"
    conv_out = "decoder.head.2.weight" if original else "decoder.conv_out.weight"
    post = "conv2.weight" if original else "post_quant_conv.weight"
    for key in (conv_in, conv_out, post):
        if key not in files:
            raise CheckpointError(f"{where}: missing tensor {key!r} for the {layout} Wan VAE layout")
    preset = WanVAEConfig.preset("wan2.2-vae" if RESIDUAL_MARKERS[layout] in files else "wan2.1-vae")
    base, c_in = (int(d) for d in files.tensor(conv_in).shape[:2])  # torch conv weights: [O, I, *k]
    c_out, decoder_base = (int(d) for d in files.tensor(conv_out).shape[:2])
    z = int(files.tensor(post).shape[0])
    found = dict(in_channels=c_in, out_channels=c_out, base_dim=base, z_dim=z)
    decoder_base //= preset.dim_mult[0]  # the decoder's last level is dim_mult[0] times its base
    found["decoder_base_dim"] = None if decoder_base == base else decoder_base
    if z != preset.z_dim:
        found.update(latents_mean=(0.0,) * z, latents_std=(1.0,) * z)
    return dataclasses.replace(preset, **found)


def detect(
    path: str | os.PathLike[str], config: WanVAEConfig | Mapping[str, Any] | None = None
) -> WanVAECheckpoint:
    """Open a Wan VAE (2.1 or 2.2) of either layout (see the module docstring) and work out its config."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    weights, config_file = _find(path)
    if weights.is_dir():
        files: Any = _diffusers_files(weights)
    elif weights.suffix in (".pth", ".pt", ".ckpt"):
        files = read_pth(weights)
    else:
        files = open_checkpoint(weights)
    where = str(weights)
    if DIFFUSERS_MARKER in files:
        layout = "diffusers"
    elif ORIGINAL_MARKER in files:
        layout = "original"
    else:
        raise CheckpointError(f"{where}: not a Wan VAE (no {DIFFUSERS_MARKER!r} or {ORIGINAL_MARKER!r})")
    if isinstance(config, Mapping):
        config = WanVAEConfig.from_diffusers(as_wan_config(config))
    if config is None and config_file is not None:
        try:
            data = json.loads(config_file.read_text(encoding="utf-8"))
            config = WanVAEConfig.from_diffusers(as_wan_config(data))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{config_file}: {e}") from None
    if config is None:
        config = _infer_config(files, layout, where)
    return WanVAECheckpoint(files, layout, config, where)


def _diffusers_files(folder: Path) -> Any:
    from converters.safetensors_io import CheckpointFiles

    indexes = sorted(folder.glob("diffusion_pytorch_model*.safetensors.index.json"))
    if len(indexes) == 1:
        return CheckpointFiles.from_index(indexes[0])
    return CheckpointFiles(sorted(folder.glob("diffusion_pytorch_model*.safetensors")))


# --------------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------------


def diffusers_to_params(cfg: WanVAEConfig, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A diffusers state dict (numpy-convertible values) -> jaxdit parameter arrays, by dotted path."""
    lazies = resolve(diffusers_table(cfg), StateDict(state_dict), parameter_shapes(cfg))
    return {path: np.asarray(t) for path, t in lazies.items()}


def write_original_pth(cfg: WanVAEConfig, params: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """jaxdit parameters -> Wan's original ``.pth`` (``torch.save`` of the state dict), written atomically."""
    torch = torch_module("writing Wan's original .pth VAE")
    path = Path(path)
    tensors = invert(original_table(cfg), params)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path
