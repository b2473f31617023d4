"""The model-family registry: everything outside a family's own files finds the family here.

``FAMILIES`` holds every registered :class:`~jaxdit.families.base.ModelFamily` (FLUX.1, Wan, the
bundled tiny-digits). The
functions below are the family-agnostic entry points built on it: which family a checkpoint, a folder
or a preset name belongs to, :func:`load_transformer` (a checkpoint on a mesh, called like diffusers'
model), :func:`load_params` and :func:`convert_checkpoint`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from converters import orbax_io
from converters.errors import CheckpointError
from converters.safetensors_io import open_checkpoint
from jaxdit import loading
from jaxdit.cache import hooks as cache_hooks
from jaxdit.families.base import ModelFamily, Preset
from jaxdit.families.flux import FLUX
from jaxdit.families.flux2 import FLUX2
from jaxdit.families.flux2_dev import FLUX2_DEV
from jaxdit.families.flux_kontext import FLUX_KONTEXT
from jaxdit.families.hunyuan_video15 import HUNYUAN_VIDEO15
from jaxdit.families.hunyuan_video15_i2v import HUNYUAN_VIDEO15_I2V
from jaxdit.families.qwen_image import QWEN_IMAGE
from jaxdit.families.qwen_image_edit import QWEN_IMAGE_EDIT
from jaxdit.families.tiny_digits import TINY_DIGITS
from jaxdit.families.wan import WAN
from jaxdit.families.z_image import Z_IMAGE
from jaxdit.mesh import DeviceMesh, MeshLike, ParallelConfig
from jaxdit.models.sharded_forward import validate_forward
from jaxdit.parallel.kernels import with_backend
from jaxdit.pipelines.call_options import CallOption
from jaxdit.pipelines.model_folder import ModelFolder, open_diffusers_folder

__all__ = [
    "FAMILIES",
    "ModelFamily",
    "Preset",
    "convert_checkpoint",
    "detect_family",
    "bundled",
    "bundled_names",
    "call_options",
    "for_config",
    "get",
    "load_params",
    "load_transformer",
    "open_folder",
    "preset",
    "presets",
    "register",
]

PathLike = str | os.PathLike[str]

#: name -> family, in the order checkpoints are tried.
FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> None:
    if family.name in FAMILIES:
        raise ValueError(f"a model family named {family.name!r} is registered already")
    FAMILIES[family.name] = family
    if family.variant_of is None:  # a variant shares its base family's transformer and cache hooks
        cache_hooks.register_family(family.checkpoints.config_class, family)


register(FLUX)
register(FLUX2)
register(WAN)
register(
    FLUX_KONTEXT
)  # a variant of FLUX: a bare FLUX.1-shaped checkpoint is FLUX's until a folder says Kontext
register(TINY_DIGITS)
register(Z_IMAGE)
register(QWEN_IMAGE)
register(QWEN_IMAGE_EDIT)  # a variant of Qwen-Image: found by its folder's pipeline class
register(FLUX2_DEV)  # a variant of FLUX.2: found by its folder's pipeline class (Flux2Pipeline)
register(HUNYUAN_VIDEO15)
register(HUNYUAN_VIDEO15_I2V)  # a variant of HunyuanVideo 1.5: found by its folder's pipeline class


def get(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def bundled(name: str | None = None) -> ModelFamily | None:
    """The family that ships a model of this name (None: the default one, the first registered), or None
    when ``name`` names no bundled model."""
    shipped = [f for f in FAMILIES.values() if f.bundled]
    if name is None:
        return shipped[0] if shipped else None
    return next((f for f in shipped if f.name == name), None)


def bundled_names() -> list[str]:
    return [f.name for f in FAMILIES.values() if f.bundled]


def for_config(config: Any) -> ModelFamily:
    """The family whose config class ``config`` is an instance of."""
    for family in FAMILIES.values():
        if family.variant_of is None and isinstance(config, family.checkpoints.config_class):
            return family
    raise ValueError(f"{type(config).__name__} is the config of no registered model family")


def call_options() -> dict[str, tuple[CallOption, list[ModelFamily]]]:
    """Every registered family's own call arguments (its pipeline's ``call_options``) by flag name: the
    first declaration (what ``jaxdit generate`` parses the flag with) and every family that declares it."""
    found: dict[str, tuple[CallOption, list[ModelFamily]]] = {}
    for family in FAMILIES.values():
        for option in family.pipeline_class.call_options:
            found.setdefault(option.flag_name, (option, []))[1].append(family)
    return found


def presets() -> dict[str, tuple[ModelFamily, Preset]]:
    """Every preset name -> (its family, the preset)."""
    return {name: (f, p) for f in FAMILIES.values() for name, p in f.presets.items()}


def preset(name: str) -> tuple[ModelFamily, Preset]:
    known = presets()
    if name not in known:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(known)}")
    return known[name]


# --------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------


def detect_family(path: PathLike) -> ModelFamily:
    """The family of a transformer checkpoint (BFL / diffusers / original file or folder, or an orbax
    folder written by ``jaxdit convert``); a ``CheckpointError`` naming the path otherwise."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if orbax_io.is_orbax_checkpoint(path):
        name = orbax_io.read_metadata(path)["family"]
        if name not in FAMILIES:
            raise CheckpointError(f"{path}: checkpoint of unknown family {name!r}")
        return FAMILIES[name]
    for family in FAMILIES.values():
        if family.variant_of is None and family.checkpoints.detect(path):
            return family
    # Nothing recognised it. A damaged file is the likelier story: let the reader say what is wrong with
    # it (truncated, bad header), naming the file.
    open_checkpoint(path)
    raise CheckpointError(
        f"{path}: not a checkpoint of a known model family ({', '.join(FAMILIES)}); expected a BFL or "
        "diffusers file/folder, an original Wan folder, or a folder written by `jaxdit convert`"
    )


def load_params(
    path: PathLike,
    mesh: MeshLike,
    dtype: Any = None,
    *,
    config: Any = None,
    rules: Mapping[str, object] | None = None,
    check: Callable[[Any], None] | None = None,
) -> tuple[ModelFamily, Any]:
    """Read any supported checkpoint into a model on ``mesh``; returns (its family, the model)."""
    family = detect_family(path)
    model = loading.load_params(
        path, mesh, dtype, checkpoints=family.checkpoints, config=config, rules=rules, check=check
    )
    return family, model


def load_transformer(
    path: PathLike,
    parallel: ParallelConfig | MeshLike | None = None,
    dtype: Any = None,
    *,
    config: Any = None,
    kernel: Mapping[str, Any] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    attention_backend: str | None = None,
) -> Callable[..., Any]:
    """Load a transformer checkpoint onto a mesh; returns a callable mirroring diffusers' ``forward``.

    Args:
      path: a BFL ``.safetensors`` file, a diffusers model or pipeline folder, an original Wan 2.1
        folder or file, or a folder written by ``jaxdit convert`` (orbax).
      parallel: a :class:`ParallelConfig` (its mesh uses the first ``num_devices`` devices) or a mesh;
        None runs on one device.
      dtype: parameter and compute dtype (e.g. ``jnp.bfloat16``); default: the checkpoint's.
      config: overrides the config read or inferred from the checkpoint (needed for BFL files whose RoPE
        split is not FLUX.1's).
      kernel: local attention kernel options (``backend``, the XLA kernel's ``block_q``/``block_k``).
      compiler_options: XLA options for the compiled step (see ``ShardedForward``).
      attention_backend: auto (default), xla, cudnn, triton or splash: ``kernel["backend"]``
        (``jaxdit.parallel.kernels``); checked before any weight is read.

    The callable is the family's (``FluxForward``, ``WanForward``).
    """
    kernel = with_backend(kernel, attention_backend)
    where = DeviceMesh.of(parallel)
    # Heads vs ulysses x tensor (and no pipefusion) before a single weight is read.
    check = lambda cfg: validate_forward(where.parallel, cfg.num_heads)
    family, model = load_params(path, where, dtype, config=config, check=check)
    return family.wrap(model, where, kernel=kernel, compiler_options=compiler_options)


def convert_checkpoint(
    src: PathLike,
    dst: PathLike,
    dtype: Any = None,
    *,
    config: Any = None,
    overwrite: bool = False,
    loras: Any = (),
    fp8: bool = False,
) -> Path:
    """Convert any supported checkpoint into a jaxdit (orbax) folder, atomically; ``loras`` ((path,
    scale) pairs) are fused into the weights first; ``fp8``: the block stacks' linear layers in FP8."""
    family = detect_family(src)
    return loading.convert_checkpoint(
        src,
        dst,
        dtype,
        checkpoints=family.checkpoints,
        config=config,
        overwrite=overwrite,
        loras=loras,
        fp8=fp8,
    )


# --------------------------------------------------------------------------------------------------------
# Folders
# --------------------------------------------------------------------------------------------------------


def open_folder(path: PathLike) -> tuple[ModelFamily, ModelFolder]:
    """Which family's pipeline a downloaded folder holds, with every component found (see
    ``jaxdit.pipelines.model_folder``); one ``ValueError`` naming what is wrong otherwise."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(
            f"{root} is not a folder (a downloaded diffusers pipeline or a model's release folder)"
        )
    if (root / "model_index.json").is_file():
        classes = {name: c for f in FAMILIES.values() for name, c in f.folder_classes.items()}
        folder = open_diffusers_folder(root, classes)
        family = FAMILIES[folder.family]
        family.check_folder(folder)
        return family, folder
    for family in FAMILIES.values():
        folder = family.original_folder(root)
        if folder is not None:
            return family, folder
    if (root / "config.json").is_file() and not (root / "vae").exists():
        raise ValueError(
            f"{root} holds a single model (config.json) but no pipeline: a prompt needs the text encoders and "
            "the VAE too; pass the pipeline folder (with model_index.json), or prompt embeddings and latents"
        )
    raise ValueError(
        f"{root} is neither a diffusers pipeline folder (no model_index.json) nor a release folder of a "
        f"known family ({', '.join(f.display for f in FAMILIES.values())})"
    )


def is_pipeline_folder(path: PathLike | None) -> bool:
    """Does ``path`` look like a whole pipeline (as opposed to a transformer checkpoint)?"""
    if path is None or not Path(path).is_dir():
        return False
    root = Path(path)
    if (root / "model_index.json").exists():
        return True
    try:
        return any(f.original_folder(root) is not None for f in FAMILIES.values())
    except ValueError:
        return True  # one of them recognised it and found it broken: opening it says why
