"""FLUX.1 checkpoints -> jaxdit parameters: the BFL and diffusers key tables, layout detection, BFL export.

Layouts (BFL's ``src/flux/model.py`` and diffusers' ``convert_flux_transformer_checkpoint_to_diffusers`` in
``loaders/single_file_utils.py`` name every key and shape):

- BFL single file (``flux1-dev.safetensors``, ``flux1-schnell.safetensors``), also with ComfyUI's
  ``model.diffusion_model.`` prefix. Fused ``qkv`` and single-block ``linear1``/``linear2``; the final
  modulation is (shift, scale). The config is inferred from the keys.
- diffusers ``FluxTransformer2DModel`` folder: ``config.json`` + ``diffusion_pytorch_model*.safetensors``
  (a sharded one has its ``*.index.json``), on its own or as the ``transformer/`` folder of a pipeline.
  Separate q/k/v; ``norm_out`` is (scale, shift).

jaxdit's parameters follow BFL's modules (see ``jaxdit/models/flux.py``), except that the fused
projections are split so that tensor parallelism shards whole heads. The named hooks below are the whole
difference: :func:`split_qkv`, :func:`split_linear1`, :func:`split_linear2`, :func:`swap_scale_shift`
and the kernel transposes. :func:`write_bfl` inverts the BFL table to write a BFL file from a diffusers
state dict (the tests' BFL checkpoints are made that way).
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
    invert,
    resolve,
)
from converters.safetensors_io import CheckpointFiles, open_checkpoint, write_safetensors
from jaxdit.models.flux import FluxConfig, abstract_model

__all__ = [
    "BFL_PREFIX",
    "CHECKPOINTS",
    "FluxCheckpoint",
    "bfl_table",
    "detect",
    "diffusers_table",
    "split_linear1",
    "split_linear2",
    "split_qkv",
    "swap_scale_shift",
    "write_bfl",
]

#: ComfyUI-style single files prefix every BFL key with this.
BFL_PREFIX = "model.diffusion_model."
DIFFUSERS_CLASS = "FluxTransformer2DModel"


# --------------------------------------------------------------------------------------------------------
# Named hooks
# --------------------------------------------------------------------------------------------------------


def split_qkv(part: int, hidden: int, *, weight: bool) -> Slice:
    """q (0), k (1) or v (2) out of a fused [3E, E] qkv weight (as an [E, E] kernel) or [3E] bias."""
    return Slice(0, part * hidden, (part + 1) * hidden, transpose=weight, label=f"split_qkv {'qkv'[part]}")


def split_linear1(part: int, hidden: int, mlp: int, *, weight: bool) -> Slice:
    """q, k, v (0-2) or the MLP input (3) out of a single block's fused ``linear1`` [3E + F, E]."""
    start = part * hidden
    stop = start + (mlp if part == 3 else hidden)
    return Slice(0, start, stop, transpose=weight, label=f"split_linear1 {('q', 'k', 'v', 'mlp')[part]}")


def split_linear2(part: int, hidden: int, mlp: int) -> Slice:
    """The attention (0) or MLP (1) input columns of a single block's ``linear2`` [E, E + F], as a kernel."""
    start, stop = (0, hidden) if part == 0 else (hidden, hidden + mlp)
    return Slice(1, start, stop, transpose=True, label=f"split_linear2 {('attn', 'mlp')[part]}")


def swap_scale_shift(*, weight: bool) -> SwapHalves:
    """diffusers' ``norm_out`` (scale, shift) as BFL's (shift, scale) final modulation."""
    return SwapHalves(transpose=weight)


# --------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------


def _linear(target: str, source: str, stack: str | None = None, bias: bool = True) -> list[KeyRule]:
    rules = [KeyRule(f"{target}.kernel", f"{source}.weight", TRANSPOSE, stack)]
    if bias:
        rules.append(KeyRule(f"{target}.bias", f"{source}.bias", IDENTITY, stack))
    return rules


def _embedders(cfg: FluxConfig, names: Mapping[str, str]) -> list[KeyRule]:
    rules = _linear("img_in", names["img_in"]) + _linear("txt_in", names["txt_in"])
    for target in ("time_in", "vector_in") + (("guidance_in",) if cfg.guidance_embed else ()):
        rules += _linear(f"{target}.in_layer", names[target] + names["in_layer"])
        rules += _linear(f"{target}.out_layer", names[target] + names["out_layer"])
    return rules


def bfl_table(cfg: FluxConfig) -> KeyTable:
    """BFL ``Flux`` state dict -> jaxdit parameters."""
    e, f, bias = cfg.hidden_size, cfg.mlp_hidden, cfg.qkv_bias
    names = {
        "img_in": "img_in",
        "txt_in": "txt_in",
        "time_in": "time_in",
        "vector_in": "vector_in",
        "guidance_in": "guidance_in",
        "in_layer": ".in_layer",
        "out_layer": ".out_layer",
    }
    rules = _embedders(cfg, names)
    d, s = "double_blocks", "single_blocks"
    for stream in ("img", "txt"):
        src = f"{d}.{{i}}.{stream}"
        rules += _linear(f"{d}.{stream}_mod", f"{src}_mod.lin", d)
        for part, name in enumerate("qkv"):
            rules.append(
                KeyRule(
                    f"{d}.{stream}_attn.{name}.kernel",
                    f"{src}_attn.qkv.weight",
                    split_qkv(part, e, weight=True),
                    d,
                )
            )
            if bias:
                rules.append(
                    KeyRule(
                        f"{d}.{stream}_attn.{name}.bias",
                        f"{src}_attn.qkv.bias",
                        split_qkv(part, e, weight=False),
                        d,
                    )
                )
        rules.append(KeyRule(f"{d}.{stream}_attn.q_norm", f"{src}_attn.norm.query_norm.scale", IDENTITY, d))
        rules.append(KeyRule(f"{d}.{stream}_attn.k_norm", f"{src}_attn.norm.key_norm.scale", IDENTITY, d))
        rules += _linear(f"{d}.{stream}_proj", f"{src}_attn.proj", d)
        rules += _linear(f"{d}.{stream}_mlp.fc1", f"{src}_mlp.0", d)
        rules += _linear(f"{d}.{stream}_mlp.fc2", f"{src}_mlp.2", d)
    src = f"{s}.{{i}}"
    rules += _linear(f"{s}.modulation", f"{src}.modulation.lin", s)
    for part, name in enumerate(("attn.q", "attn.k", "attn.v", "mlp_in")):
        rules.append(
            KeyRule(f"{s}.{name}.kernel", f"{src}.linear1.weight", split_linear1(part, e, f, weight=True), s)
        )
        rules.append(
            KeyRule(f"{s}.{name}.bias", f"{src}.linear1.bias", split_linear1(part, e, f, weight=False), s)
        )
    rules.append(KeyRule(f"{s}.attn.q_norm", f"{src}.norm.query_norm.scale", IDENTITY, s))
    rules.append(KeyRule(f"{s}.attn.k_norm", f"{src}.norm.key_norm.scale", IDENTITY, s))
    rules.append(KeyRule(f"{s}.out_attn.kernel", f"{src}.linear2.weight", split_linear2(0, e, f), s))
    rules.append(KeyRule(f"{s}.out_mlp.kernel", f"{src}.linear2.weight", split_linear2(1, e, f), s))
    rules.append(KeyRule(f"{s}.out_attn.bias", f"{src}.linear2.bias", IDENTITY, s))
    rules += _linear("final_layer.adaLN_modulation", "final_layer.adaLN_modulation.1")
    rules += _linear("final_layer.linear", "final_layer.linear")
    return KeyTable("FLUX BFL", tuple(_drop_empty(rules, cfg)), {d: cfg.depth, s: cfg.depth_single_blocks})


def diffusers_table(cfg: FluxConfig) -> KeyTable:
    """diffusers ``FluxTransformer2DModel`` state dict -> jaxdit parameters."""
    e, f = cfg.hidden_size, cfg.mlp_hidden
    names = {
        "img_in": "x_embedder",
        "txt_in": "context_embedder",
        "time_in": "time_text_embed.timestep_embedder",
        "vector_in": "time_text_embed.text_embedder",
        "guidance_in": "time_text_embed.guidance_embedder",
        "in_layer": ".linear_1",
        "out_layer": ".linear_2",
    }
    rules = _embedders(cfg, names)
    d, s = "double_blocks", "single_blocks"
    blk = "transformer_blocks.{i}"
    per_stream = {
        "img": ("norm1", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "attn.to_out.0", "ff"),
        "txt": (
            "norm1_context",
            ("add_q_proj", "add_k_proj", "add_v_proj"),
            ("norm_added_q", "norm_added_k"),
            "attn.to_add_out",
            "ff_context",
        ),
    }
    for stream, (norm, qkv, qk_norms, proj, ff) in per_stream.items():
        rules += _linear(f"{d}.{stream}_mod", f"{blk}.{norm}.linear", d)
        for name, src in zip("qkv", qkv, strict=True):
            rules += _linear(f"{d}.{stream}_attn.{name}", f"{blk}.attn.{src}", d, bias=cfg.qkv_bias)
        rules.append(KeyRule(f"{d}.{stream}_attn.q_norm", f"{blk}.attn.{qk_norms[0]}.weight", IDENTITY, d))
        rules.append(KeyRule(f"{d}.{stream}_attn.k_norm", f"{blk}.attn.{qk_norms[1]}.weight", IDENTITY, d))
        rules += _linear(f"{d}.{stream}_proj", f"{blk}.{proj}", d)
        rules += _linear(f"{d}.{stream}_mlp.fc1", f"{blk}.{ff}.net.0.proj", d)
        rules += _linear(f"{d}.{stream}_mlp.fc2", f"{blk}.{ff}.net.2", d)
    sblk = "single_transformer_blocks.{i}"
    rules += _linear(f"{s}.modulation", f"{sblk}.norm.linear", s)
    for name in "qkv":
        rules += _linear(f"{s}.attn.{name}", f"{sblk}.attn.to_{name}", s)
    rules.append(KeyRule(f"{s}.attn.q_norm", f"{sblk}.attn.norm_q.weight", IDENTITY, s))
    rules.append(KeyRule(f"{s}.attn.k_norm", f"{sblk}.attn.norm_k.weight", IDENTITY, s))
    rules += _linear(f"{s}.mlp_in", f"{sblk}.proj_mlp", s)
    rules.append(KeyRule(f"{s}.out_attn.kernel", f"{sblk}.proj_out.weight", split_linear2(0, e, f), s))
    rules.append(KeyRule(f"{s}.out_mlp.kernel", f"{sblk}.proj_out.weight", split_linear2(1, e, f), s))
    rules.append(KeyRule(f"{s}.out_attn.bias", f"{sblk}.proj_out.bias", IDENTITY, s))
    rules.append(
        KeyRule(
            "final_layer.adaLN_modulation.kernel", "norm_out.linear.weight", swap_scale_shift(weight=True)
        )
    )
    rules.append(
        KeyRule("final_layer.adaLN_modulation.bias", "norm_out.linear.bias", swap_scale_shift(weight=False))
    )
    rules += _linear("final_layer.linear", "proj_out")
    return KeyTable(
        "FLUX diffusers", tuple(_drop_empty(rules, cfg)), {d: cfg.depth, s: cfg.depth_single_blocks}
    )


def _drop_empty(rules: list[KeyRule], cfg: FluxConfig) -> list[KeyRule]:
    """A model without double (or single) blocks has no such parameters."""
    empty = {
        name
        for name, n in (("double_blocks", cfg.depth), ("single_blocks", cfg.depth_single_blocks))
        if n == 0
    }
    return [r for r in rules if r.stack not in empty]


# --------------------------------------------------------------------------------------------------------
# Layout detection
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FluxCheckpoint:
    """An opened FLUX checkpoint: its files, layout, key prefix and model config."""

    files: CheckpointFiles
    layout: str  # "bfl" or "diffusers"
    prefix: str
    config: FluxConfig

    @property
    def table(self) -> KeyTable:
        return bfl_table(self.config) if self.layout == "bfl" else diffusers_table(self.config)

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype (of the image embedding's weight)."""
        key = self.prefix + ("img_in.weight" if self.layout == "bfl" else "x_embedder.weight")
        return self.files.dtype(key)

    def resolve(self, expected: Mapping[str, tuple[int, ...]]):
        """Lazy target tensors (see :func:`converters.keymap.resolve`)."""
        return resolve(self.table, self.files, expected, prefix=self.prefix)


def _diffusers_folder(path: Path) -> Path | None:
    """The folder holding a diffusers FLUX transformer: ``path`` itself or a pipeline's ``transformer/``."""
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


def is_flux_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` looks like a FLUX transformer checkpoint (cheap: config or header keys only)."""
    path = Path(path)
    if path.is_dir():
        if _diffusers_folder(path) is not None:
            return True
        if (path / "config.json").is_file():
            return False
    try:
        keys = set(open_checkpoint(path).keys())
    except CheckpointError:
        return False
    if not any(k in keys for k in ("img_in.weight", BFL_PREFIX + "img_in.weight", "x_embedder.weight")):
        return False
    # FLUX.1 modulates every block from its own linear layer; FLUX.2 (whose files share img_in.weight and
    # x_embedder.weight) has one modulation per stack and none per block.
    return any(k.endswith(_PER_BLOCK_MODULATION) for k in keys)


#: Tensor-name endings only FLUX.1's per-block modulation has (BFL double/single, diffusers double/single).
_PER_BLOCK_MODULATION = (
    ".img_mod.lin.weight",
    ".modulation.lin.weight",
    ".norm1.linear.weight",
    ".norm.linear.weight",
)


def _diffusers_shapes_to_config(shapes: Mapping[str, tuple[int, ...]]) -> FluxConfig:
    """A diffusers-keyed single file without its config.json: infer like the BFL loader does."""
    hidden, in_channels = shapes["x_embedder.weight"]
    head_dim = (
        shapes["transformer_blocks.0.attn.norm_q.weight"][0]
        if "transformer_blocks.0.attn.norm_q.weight" in shapes
        else shapes["single_transformer_blocks.0.attn.norm_q.weight"][0]
    )

    def count(prefix: str) -> int:
        idx = {int(k[len(prefix) :].split(".", 1)[0]) for k in shapes if k.startswith(prefix)}
        return max(idx) + 1 if idx else 0

    if head_dim != 128:
        raise CheckpointError(
            f"head_dim {head_dim}: pass the config (RoPE axes cannot be inferred from weights)"
        )
    return FluxConfig(
        in_channels=in_channels,
        out_channels=shapes["proj_out.weight"][0],
        vec_in_dim=shapes["time_text_embed.text_embedder.linear_1.weight"][1],
        context_in_dim=shapes["context_embedder.weight"][1],
        hidden_size=hidden,
        num_heads=hidden // head_dim,
        depth=count("transformer_blocks."),
        depth_single_blocks=count("single_transformer_blocks."),
        guidance_embed="time_text_embed.guidance_embedder.linear_1.weight" in shapes,
    )


def detect(
    path: str | os.PathLike[str], config: FluxConfig | Mapping[str, Any] | None = None
) -> FluxCheckpoint:
    """Open a FLUX checkpoint of any supported layout and work out its config.

    ``path``: a BFL ``.safetensors`` file (with or without the ``model.diffusion_model.`` prefix), a
    diffusers transformer folder (``config.json`` + weights, sharded with an index or not), a pipeline
    folder with ``transformer/``, or an ``*.index.json``. ``config`` overrides the inferred config (a
    ``FluxConfig``, or a diffusers config dict); its shapes are still checked against every tensor.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if isinstance(config, Mapping):
        config = FluxConfig.from_diffusers(config)
    folder = _diffusers_folder(path) if path.is_dir() else None
    if folder is not None:
        files = open_checkpoint(folder)
        cfg = config or FluxConfig.from_diffusers(folder / "config.json")
        return FluxCheckpoint(files, "diffusers", "", cfg)
    files = open_checkpoint(path)
    keys = set(files.keys())
    for prefix in ("", BFL_PREFIX):
        if prefix + "img_in.weight" in keys:
            if config is None:
                n = len(prefix)
                shapes = {k[n:]: files.shape(k) for k in keys if k.startswith(prefix)}
                try:
                    config = FluxConfig.from_bfl_keys(shapes)
                except (KeyError, ValueError) as e:
                    raise CheckpointError(f"{_name(files)}: {e.args[0]}") from None
            return FluxCheckpoint(files, "bfl", prefix, config)
    if "x_embedder.weight" in keys:
        if config is None:
            try:
                config = _diffusers_shapes_to_config({k: files.shape(k) for k in keys})
            except KeyError as e:
                raise CheckpointError(
                    f"{_name(files)}: cannot infer the FLUX config, no tensor {e}"
                ) from None
        return FluxCheckpoint(files, "diffusers", "", config)
    raise CheckpointError(
        f"{_name(files)}: not a FLUX checkpoint (no 'img_in.weight', '{BFL_PREFIX}img_in.weight' or "
        "'x_embedder.weight'; expected a BFL file or a diffusers FluxTransformer2DModel folder)"
    )


def _name(files: CheckpointFiles) -> str:
    return str(files.index_path or ", ".join(str(f.path) for f in files.files))


# --------------------------------------------------------------------------------------------------------
# Export (tests, and anyone who wants a BFL file from diffusers weights)
# --------------------------------------------------------------------------------------------------------


def diffusers_to_params(cfg: FluxConfig, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A diffusers state dict (numpy-convertible values) -> jaxdit parameter arrays, by path."""
    from jaxdit.models.flux import parameter_shapes

    lazies = resolve(diffusers_table(cfg), StateDict(state_dict), parameter_shapes(cfg))
    return {path: np.asarray(t) for path, t in lazies.items()}


def write_bfl(
    cfg: FluxConfig, state_dict: Mapping[str, Any], path: str | os.PathLike[str], *, prefix: str = ""
) -> Path:
    """Write a diffusers state dict as a BFL single file (atomically), through the inverted BFL table."""
    bfl = invert(bfl_table(cfg), diffusers_to_params(cfg, state_dict), prefix=prefix)
    return write_safetensors(path, bfl)


#: FLUX checkpoints as ``jaxdit.loading`` reads them (BFL, diffusers, or a ``jaxdit convert`` folder).
CHECKPOINTS = CheckpointFormat(
    name="flux",
    detect=is_flux_checkpoint,
    open=detect,
    config_class=FluxConfig,
    abstract_model=abstract_model,
)
