"""FLUX.2 transformer checkpoints -> jaxdit parameters (``jaxdit/models/flux2.py``).

Layouts (diffusers' ``convert_flux2_transformer_checkpoint_to_diffusers`` in
``loaders/single_file_utils.py`` names every key of both):

- diffusers ``Flux2Transformer2DModel``: a ``transformer/`` folder with ``config.json`` and safetensors
  (sharded with its ``*.index.json`` as black-forest-labs/FLUX.2-dev ships it), or the pipeline folder
  holding it;
- BFL's single file (``flux2-dev.safetensors``), bare or under ComfyUI's ``model.diffusion_model.`` /
  ``diffusion_model.``: fused ``qkv`` in the double blocks, the final modulation in (shift, scale)
  order; its config is inferred from the shapes (the RoPE split is FLUX.2's (32, 32, 32, 32) for
  head_dim 128 and must be given otherwise).

Every projection is bias-free; the fused tensors are split so that tensor parallelism shards whole heads
and matching SwiGLU units:

- a SwiGLU ``linear_in`` [2F, E]: the gate rows, then the value rows (:func:`split_swiglu`);
- a single block's ``to_qkv_mlp_proj`` [3E + 2F, E]: q, k, v, MLP gate, MLP value
  (:func:`split_qkv_mlp`), and its ``to_out`` [E, E + F]: attention, then MLP input columns
  (:func:`split_out`) (BFL: ``linear1`` and ``linear2``, the same tensors);
- BFL's double-block ``qkv`` [3E, E]: q, k, v (:func:`split_qkv`).

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
from converters.keymap import (
    IDENTITY,
    TRANSPOSE,
    KeyRule,
    KeyTable,
    Slice,
    StateDict,
    SwapHalves,
    resolve,
    where,
)
from converters.safetensors_io import CheckpointFiles, open_checkpoint
from jaxdit.models.flux2 import abstract_model
from jaxdit.models.flux2_config import Flux2Config

__all__ = [
    "CHECKPOINTS",
    "COMFY_PREFIXES",
    "Flux2Checkpoint",
    "bfl_table",
    "config_from_bfl_shapes",
    "detect",
    "diffusers_table",
    "diffusers_to_params",
    "split_out",
    "split_qkv",
    "split_qkv_mlp",
    "split_swiglu",
]

DIFFUSERS_CLASS = "Flux2Transformer2DModel"
DOUBLE, SINGLE = "double_blocks", "single_blocks"
#: ComfyUI single files put every BFL key under one of these (or none).
COMFY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
#: A key only BFL's FLUX.2 layout has (diffusers' single-file loader recognises FLUX.2 by it).
BFL_PROBE = "single_stream_modulation.lin.weight"


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


def split_qkv(part: int, hidden: int) -> Slice:
    """q (0), k (1) or v (2) of BFL's fused double-block ``qkv`` [3E, E], as an [E, E] kernel."""
    return Slice(0, part * hidden, (part + 1) * hidden, transpose=True, label=f"split_qkv {'qkv'[part]}")


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
    return _table("FLUX.2 diffusers", rules, cfg)


def _table(name: str, rules: list[KeyRule], cfg: Flux2Config) -> KeyTable:
    """The table of ``rules`` for ``cfg`` (a model without double or single blocks has no such keys)."""
    empty = {stack for stack, n in ((DOUBLE, cfg.num_layers), (SINGLE, cfg.num_single_layers)) if n == 0}
    rules = [r for r in rules if r.stack not in empty]
    return KeyTable(name, tuple(rules), {DOUBLE: cfg.num_layers, SINGLE: cfg.num_single_layers})


def bfl_table(cfg: Flux2Config) -> KeyTable:
    """BFL's FLUX.2 state dict -> jaxdit parameters."""
    e, f = cfg.hidden_size, cfg.mlp_hidden
    rules = [_kernel("img_in", "img_in"), _kernel("txt_in", "txt_in")]
    for target in ("time_in",) + ("guidance_in",) * cfg.guidance_embeds:
        rules += [
            _kernel(f"{target}.linear_1", f"{target}.in_layer"),
            _kernel(f"{target}.linear_2", f"{target}.out_layer"),
        ]
    rules += [
        _kernel("double_mod_img", "double_stream_modulation_img.lin"),
        _kernel("double_mod_txt", "double_stream_modulation_txt.lin"),
        _kernel("single_mod", "single_stream_modulation.lin"),
    ]
    d = "double_blocks.{i}"
    for stream in ("img", "txt"):
        for part, name in enumerate("qkv"):
            rules.append(
                KeyRule(
                    f"{DOUBLE}.{stream}_attn.{name}.kernel",
                    f"{d}.{stream}_attn.qkv.weight",
                    split_qkv(part, e),
                    DOUBLE,
                )
            )
        for name, src in (("q_norm", "query_norm"), ("k_norm", "key_norm")):
            rules.append(
                KeyRule(
                    f"{DOUBLE}.{stream}_attn.{name}", f"{d}.{stream}_attn.norm.{src}.scale", IDENTITY, DOUBLE
                )
            )
        rules.append(_kernel(f"{DOUBLE}.{stream}_proj", f"{d}.{stream}_attn.proj", DOUBLE))
        for part, name in enumerate(("gate", "value")):
            rules.append(
                KeyRule(
                    f"{DOUBLE}.{stream}_mlp.{name}.kernel",
                    f"{d}.{stream}_mlp.0.weight",
                    split_swiglu(part, f),
                    DOUBLE,
                )
            )
        rules.append(_kernel(f"{DOUBLE}.{stream}_mlp.down", f"{d}.{stream}_mlp.2", DOUBLE))
    s = "single_blocks.{i}"
    for part, name in enumerate(("attn.q", "attn.k", "attn.v", "mlp_gate", "mlp_value")):
        rules.append(
            KeyRule(f"{SINGLE}.{name}.kernel", f"{s}.linear1.weight", split_qkv_mlp(part, e, f), SINGLE)
        )
    rules.append(KeyRule(f"{SINGLE}.attn.q_norm", f"{s}.norm.query_norm.scale", IDENTITY, SINGLE))
    rules.append(KeyRule(f"{SINGLE}.attn.k_norm", f"{s}.norm.key_norm.scale", IDENTITY, SINGLE))
    rules.append(KeyRule(f"{SINGLE}.out_attn.kernel", f"{s}.linear2.weight", split_out(0, e, f), SINGLE))
    rules.append(KeyRule(f"{SINGLE}.out_mlp.kernel", f"{s}.linear2.weight", split_out(1, e, f), SINGLE))
    # BFL's final modulation is (shift, scale); the model splits diffusers' (scale, shift).
    rules.append(
        KeyRule("norm_out.kernel", "final_layer.adaLN_modulation.1.weight", SwapHalves(transpose=True))
    )
    rules.append(_kernel("proj_out", "final_layer.linear"))
    return _table("FLUX.2 BFL", rules, cfg)


def config_from_bfl_shapes(shapes: Mapping[str, tuple[int, ...]], **overrides: Any) -> Flux2Config:
    """A BFL file's config from its tensors' shapes (keys without a prefix), as diffusers' single-file
    loader infers it. The RoPE split is not in the weights: FLUX.2's (32, 32, 32, 32) for head_dim 128,
    ``axes_dims_rope=`` otherwise."""

    def count(prefix: str) -> int:
        idx = {int(k[len(prefix) :].split(".", 1)[0]) for k in shapes if k.startswith(prefix)}
        return max(idx) + 1 if idx else 0

    hidden, in_channels = shapes["img_in.weight"]
    out = shapes["final_layer.linear.weight"][0]
    double, single = count("double_blocks."), count("single_blocks.")
    norm = (
        "double_blocks.0.img_attn.norm.query_norm.scale"
        if double
        else "single_blocks.0.norm.query_norm.scale"
    )
    head_dim = shapes[norm][0]
    mlp = (
        shapes["double_blocks.0.img_mlp.0.weight"][0] // 2
        if double
        else (shapes["single_blocks.0.linear1.weight"][0] - 3 * hidden) // 2
    )
    fields: dict[str, Any] = dict(
        in_channels=in_channels,
        # patch_size 1 (FLUX.2's): one token's features; None when they are the input's, as diffusers says
        out_channels=None if out == in_channels else out,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=head_dim,
        num_attention_heads=hidden // head_dim,
        joint_attention_dim=shapes["txt_in.weight"][1],
        timestep_guidance_channels=shapes["time_in.in_layer.weight"][1],
        mlp_ratio=mlp / hidden,
        guidance_embeds="guidance_in.in_layer.weight" in shapes,
    )
    fields.update(overrides)
    if "axes_dims_rope" not in fields and head_dim != 128:
        raise ValueError(
            f"head_dim is {head_dim}: the RoPE axes split cannot be inferred from the weights (FLUX.2 uses "
            "(32, 32, 32, 32) for head_dim 128); pass the config"
        )
    return Flux2Config(**fields)


@dataclasses.dataclass
class Flux2Checkpoint:
    """An opened FLUX.2 transformer checkpoint: its files, layout ("diffusers" or "bfl"), key prefix and
    config."""

    files: CheckpointFiles
    prefix: str
    config: Flux2Config
    layout: str = "diffusers"

    @property
    def table(self) -> KeyTable:
        return bfl_table(self.config) if self.layout == "bfl" else diffusers_table(self.config)

    @property
    def dtype(self) -> np.dtype:
        first = "img_in.weight" if self.layout == "bfl" else "x_embedder.weight"
        return self.files.dtype(self.prefix + first)

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


def _bfl_prefix(keys: set[str]) -> str | None:
    return next((p for p in COMFY_PREFIXES + ("",) if p + BFL_PROBE in keys), None)


def is_flux2_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a FLUX.2 transformer (cheap: a config or a file's header keys only)."""
    path = Path(path)
    try:  # an unreadable config or file is for the family that claims it to explain
        if path.is_dir():
            return _diffusers_folder(path) is not None
        return _bfl_prefix(set(open_checkpoint(path).keys())) is not None
    except CheckpointError:
        return False


def detect(
    path: str | os.PathLike[str], config: Flux2Config | Mapping[str, Any] | None = None
) -> Flux2Checkpoint:
    """Open a FLUX.2 transformer: a diffusers folder (its config read) or a BFL single file (its config
    inferred from the shapes). ``config``, a ``Flux2Config`` or a diffusers config dict, overrides it;
    the shapes are still checked against it."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if isinstance(config, Mapping):
        config = Flux2Config.from_diffusers(config)
    if path.is_dir():
        folder = _diffusers_folder(path)
        if folder is None:
            raise CheckpointError(
                f"{path}: not a FLUX.2 transformer folder (no config.json with _class_name "
                f"'{DIFFUSERS_CLASS}' here or in transformer/)"
            )
        try:
            cfg = config or Flux2Config.from_diffusers(folder / "config.json")
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
        return Flux2Checkpoint(open_checkpoint(folder), "", cfg)
    files = open_checkpoint(path)
    keys = set(files.keys())
    prefix = _bfl_prefix(keys)
    if prefix is None:
        raise CheckpointError(
            f"{where(files)}: not a FLUX.2 transformer (no {BFL_PROBE!r}, bare or under "
            f"{' / '.join(COMFY_PREFIXES)}; expected BFL's single file or a diffusers {DIFFUSERS_CLASS} folder)"
        )
    if config is None:
        n = len(prefix)
        try:
            config = config_from_bfl_shapes({k[n:]: files.shape(k) for k in keys if k.startswith(prefix)})
        except KeyError as e:
            raise CheckpointError(f"{where(files)}: cannot infer the FLUX.2 config, no tensor {e}") from None
        except ValueError as e:
            raise CheckpointError(f"{where(files)}: {e}") from None
    return Flux2Checkpoint(files, prefix, config, "bfl")


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
