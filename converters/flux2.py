"""FLUX.2 transformer checkpoints -> jaxdit parameters (``jaxdit/models/flux2.py``).

Layout: diffusers ``Flux2Transformer2DModel`` (a ``transformer/`` folder with ``config.json`` and
safetensors, sharded with its ``*.index.json`` as black-forest-labs/FLUX.2-dev ships it, or the pipeline
folder holding it). Every projection is bias-free; the fused tensors are split so that tensor parallelism
shards whole heads and matching SwiGLU units:

- a SwiGLU ``linear_in`` [2F, E]: the gate rows, then the value rows (:func:`split_swiglu`);
- a single block's ``to_qkv_mlp_proj`` [3E + 2F, E]: q, k, v, MLP gate, MLP value
  (:func:`split_qkv_mlp`), and its ``to_out`` [E, E + F]: attention, then MLP input columns
  (:func:`split_out`).

Every source key is consumed and a missing, extra or mis-shaped tensor is a :class:`CheckpointError`
naming the key and the file (``converters/keymap.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from converters.checkpoints import CheckpointFormat
from converters.errors import CheckpointError
from converters.keymap import IDENTITY, TRANSPOSE, KeyRule, KeyTable, Slice, StateDict, resolve, where
from converters.safetensors_io import CheckpointFiles, open_checkpoint
from jaxdit.models.flux2 import abstract_model
from jaxdit.models.flux2_config import Flux2Config

__all__ = [
    "CHECKPOINTS",
    "Flux2Checkpoint",
    "detect",
    "diffusers_table",
    "diffusers_to_params",
    "split_out",
    "split_qkv_mlp",
    "split_swiglu",
]

DIFFUSERS_CLASS = "Flux2Transformer2DModel"
DOUBLE, SINGLE = "double_blocks", "single_blocks"


def split_swiglu(part: int, mlp: int) -> Slice:
    """The gate (0) or value (1) rows of a SwiGLU ``linear_in`` [2F, E], as an [E, F] kernel."""
    return Slice(
        0, part * mlp, (part + 1) * mlp, transpose=True, label=f"split_swiglu {('gate', 'value')[part]}"
    )


def split_qkv_mlp(part: int, hidden: int, mlp: int) -> Slice:
    """q, k, v (0-2), the MLP gate (3) or value (4) rows of a single block's ``to_qkv_mlp_proj``."""
    start = part * hidden if part < 3 else 3 * hidden + (part - 3) * mlp
    stop = start + (hidden if part < 3 else mlp)
    label = f"split_qkv_mlp {('q', 'k', 'v', 'gate', 'value')[part]}"
    return Slice(0, start, stop, transpose=True, label=label)


def split_out(part: int, hidden: int, mlp: int) -> Slice:
    """The attention (0) or MLP (1) input columns of a single block's ``to_out`` [E, E + F], as a kernel."""
    start, stop = (0, hidden) if part == 0 else (hidden, hidden + mlp)
    return Slice(1, start, stop, transpose=True, label=f"split_out {('attn', 'mlp')[part]}")


def _kernel(target: str, source: str, stack: str | None = None) -> KeyRule:
    return KeyRule(f"{target}.kernel", f"{source}.weight", TRANSPOSE, stack)


def diffusers_table(cfg: Flux2Config) -> KeyTable:
    """diffusers ``Flux2Transformer2DModel`` state dict -> jaxdit parameters."""
    e, f = cfg.hidden_size, cfg.mlp_hidden
    emb = "time_guidance_embed"
    rules = [_kernel("img_in", "x_embedder"), _kernel("txt_in", "context_embedder")]
    embedders = [("time_in", "timestep_embedder")] + (
        [("guidance_in", "guidance_embedder")] * cfg.guidance_embeds
    )
    for target, source in embedders:
        rules += [_kernel(f"{target}.{n}", f"{emb}.{source}.{n}") for n in ("linear_1", "linear_2")]
    rules += [
        _kernel("double_mod_img", "double_stream_modulation_img.linear"),
        _kernel("double_mod_txt", "double_stream_modulation_txt.linear"),
        _kernel("single_mod", "single_stream_modulation.linear"),
    ]
    d = "transformer_blocks.{i}"
    per_stream = {
        "img": (("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "attn.to_out.0", "ff"),
        "txt": (
            ("add_q_proj", "add_k_proj", "add_v_proj"),
            ("norm_added_q", "norm_added_k"),
            "attn.to_add_out",
            "ff_context",
        ),
    }
    for stream, (qkv, norms, proj, ff) in per_stream.items():
        for name, src in zip("qkv", qkv, strict=True):
            rules.append(_kernel(f"{DOUBLE}.{stream}_attn.{name}", f"{d}.attn.{src}", DOUBLE))
        for name, src in zip(("q_norm", "k_norm"), norms, strict=True):
            rules.append(
                KeyRule(f"{DOUBLE}.{stream}_attn.{name}", f"{d}.attn.{src}.weight", IDENTITY, DOUBLE)
            )
        rules.append(_kernel(f"{DOUBLE}.{stream}_proj", f"{d}.{proj}", DOUBLE))
        for part, name in enumerate(("gate", "value")):
            rules.append(
                KeyRule(
                    f"{DOUBLE}.{stream}_mlp.{name}.kernel",
                    f"{d}.{ff}.linear_in.weight",
                    split_swiglu(part, f),
                    DOUBLE,
                )
            )
        rules.append(_kernel(f"{DOUBLE}.{stream}_mlp.down", f"{d}.{ff}.linear_out", DOUBLE))
    s = "single_transformer_blocks.{i}.attn"
    for part, name in enumerate(("attn.q", "attn.k", "attn.v", "mlp_gate", "mlp_value")):
        rules.append(
            KeyRule(
                f"{SINGLE}.{name}.kernel", f"{s}.to_qkv_mlp_proj.weight", split_qkv_mlp(part, e, f), SINGLE
            )
        )
    rules.append(KeyRule(f"{SINGLE}.attn.q_norm", f"{s}.norm_q.weight", IDENTITY, SINGLE))
    rules.append(KeyRule(f"{SINGLE}.attn.k_norm", f"{s}.norm_k.weight", IDENTITY, SINGLE))
    rules.append(KeyRule(f"{SINGLE}.out_attn.kernel", f"{s}.to_out.weight", split_out(0, e, f), SINGLE))
    rules.append(KeyRule(f"{SINGLE}.out_mlp.kernel", f"{s}.to_out.weight", split_out(1, e, f), SINGLE))
    # AdaLayerNormContinuous: (scale, shift), the order the model splits it in; no swap.
    rules += [_kernel("norm_out", "norm_out.linear"), _kernel("proj_out", "proj_out")]
    empty = {name for name, n in ((DOUBLE, cfg.num_layers), (SINGLE, cfg.num_single_layers)) if n == 0}
    rules = [r for r in rules if r.stack not in empty]
    return KeyTable("FLUX.2 diffusers", tuple(rules), {DOUBLE: cfg.num_layers, SINGLE: cfg.num_single_layers})


@dataclasses.dataclass
class Flux2Checkpoint:
    """An opened FLUX.2 transformer checkpoint: its files, key prefix and config."""

    files: CheckpointFiles
    prefix: str
    config: Flux2Config

    @property
    def table(self) -> KeyTable:
        return diffusers_table(self.config)

    @property
    def dtype(self) -> np.dtype:
        return self.files.dtype(self.prefix + "x_embedder.weight")

    def resolve(self, expected: Mapping[str, tuple[int, ...]]):
        return resolve(self.table, self.files, expected, prefix=self.prefix)


def _diffusers_folder(path: Path) -> Path | None:
    """The folder holding a diffusers FLUX.2 transformer: ``path`` or a pipeline's ``transformer/``."""
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


def is_flux2_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a diffusers FLUX.2 transformer folder (or a pipeline folder holding one)."""
    path = Path(path)
    return path.is_dir() and _diffusers_folder(path) is not None


def detect(
    path: str | os.PathLike[str], config: Flux2Config | Mapping[str, Any] | None = None
) -> Flux2Checkpoint:
    """Open a FLUX.2 transformer folder and read its config (``config``, a ``Flux2Config`` or a diffusers
    config dict, overrides it; the shapes are still checked against it)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if isinstance(config, Mapping):
        config = Flux2Config.from_diffusers(config)
    folder = _diffusers_folder(path) if path.is_dir() else None
    if folder is None:
        files = open_checkpoint(path) if path.is_file() else None
        raise CheckpointError(
            f"{where(files) if files is not None else path}: not a FLUX.2 transformer (expected a diffusers "
            f"{DIFFUSERS_CLASS} folder with its config.json, or a pipeline folder holding one in transformer/)"
        )
    try:
        cfg = config or Flux2Config.from_diffusers(folder / "config.json")
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    return Flux2Checkpoint(open_checkpoint(folder), "", cfg)


def diffusers_to_params(cfg: Flux2Config, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A diffusers state dict (numpy-convertible values) -> jaxdit parameter arrays, by path."""
    from jaxdit.models.flux2 import parameter_shapes

    lazies = resolve(diffusers_table(cfg), StateDict(state_dict), parameter_shapes(cfg))
    return {p: np.asarray(t) for p, t in lazies.items()}


#: FLUX.2 transformer checkpoints as ``jaxdit.loading.params.load_params`` reads them.
CHECKPOINTS = CheckpointFormat(
    name="flux2",
    detect=is_flux2_checkpoint,
    open=detect,
    config_class=Flux2Config,
    abstract_model=abstract_model,
)
