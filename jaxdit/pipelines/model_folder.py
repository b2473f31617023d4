"""What a downloaded model folder holds, found and checked before anything is read.

Two layouts are understood:

- a diffusers pipeline folder as ``save_pretrained`` / the hub writes it: ``model_index.json`` naming the
  pipeline class and one sub-folder per component (``transformer/``, ``vae/``, ``text_encoder/``,
  ``tokenizer/``, ``scheduler/``, ...). FLUX.1 (``FluxPipeline``) and Wan 2.1 (``WanPipeline``,
  ``WanImageToVideoPipeline``) are accepted.
- Wan's original release folder (``Wan-AI/Wan2.1-T2V-14B`` and the like): the transformer's
  ``config.json`` and safetensors, ``Wan2.1_VAE.pth``, ``models_t5_umt5-xxl-enc-bf16.pth`` and the
  tokenizer in ``google/umt5-xxl/``.

:func:`open_model_folder` returns a :class:`ModelFolder` naming every component's path, or raises one
``ValueError`` that lists everything missing, so a half-downloaded folder fails in a second, not after the
transformer has been read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "FLUX",
    "WAN_I2V",
    "WAN_T2V",
    "ModelFolder",
    "check_component_classes",
    "open_model_folder",
    "read_json",
]

FLUX = "flux"
WAN_T2V = "wan-t2v"
WAN_I2V = "wan-i2v"

#: diffusers pipeline class -> (kind, the components it must have).
_DIFFUSERS_PIPELINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "FluxPipeline": (
        FLUX,
        ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"),
    ),
    "WanPipeline": (WAN_T2V, ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")),
    "WanImageToVideoPipeline": (
        WAN_I2V,
        ("transformer", "vae", "text_encoder", "tokenizer", "scheduler", "image_encoder", "image_processor"),
    ),
}

#: diffusers pipeline class -> the model classes jaxdit reads for its components (a transformer of another
#: family would load into the wrong model, or fail halfway through a long read).
_WAN_CLASSES = {"transformer": ("WanTransformer3DModel",), "vae": ("AutoencoderKLWan",)}
_COMPONENT_CLASSES: dict[str, dict[str, tuple[str, ...]]] = {
    "FluxPipeline": {"transformer": ("FluxTransformer2DModel",), "vae": ("AutoencoderKL",)},
    "WanPipeline": _WAN_CLASSES,
    "WanImageToVideoPipeline": _WAN_CLASSES,
}

#: Wan's original release: what the T2V folder holds besides the transformer.
WAN_ORIGINAL_VAE = "Wan2.1_VAE.pth"
WAN_ORIGINAL_T5 = "models_t5_umt5-xxl-enc-bf16.pth"
WAN_ORIGINAL_TOKENIZER = "google/umt5-xxl"
WAN_ORIGINAL_CLIP = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"


@dataclasses.dataclass(frozen=True)
class ModelFolder:
    """A checked model folder: its kind, its layout and where each component lives.

    ``components`` maps a diffusers component name (``transformer``, ``vae``, ``text_encoder``, ...) to a
    path: a sub-folder for the diffusers layout, a file or folder for Wan's original one.
    ``scheduler_config`` is the folder's ``scheduler/scheduler_config.json`` (None for Wan's original
    folder, which has none: the sampler's defaults apply).
    """

    root: Path
    kind: str  # FLUX, WAN_T2V or WAN_I2V
    layout: str  # "diffusers" or "wan-original"
    components: dict[str, Path]
    scheduler_config: dict[str, Any] | None = None

    @property
    def is_wan(self) -> bool:
        return self.kind in (WAN_T2V, WAN_I2V)

    def __getitem__(self, component: str) -> Path:
        return self.components[component]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A folder's JSON file, or a ValueError naming the file (missing, unreadable or not JSON)."""
    return _read_json(Path(path))


def check_component_classes(
    root: Path, index: dict[str, Any], expected: dict[str, tuple[str, ...]], pipeline: str = "pipeline"
) -> None:
    """Each component's class, as ``model_index.json`` names it (``[library, class]``) and as its
    ``config.json`` ``_class_name`` says, must be one of ``expected[component]``; raises one ValueError
    listing every mismatch. Components not in ``expected``, and files that do not say, are not checked."""
    wrong = []
    for component, classes in expected.items():
        entry = index.get(component)
        if isinstance(entry, list) and len(entry) == 2 and entry[1] not in classes:
            wrong.append(f"model_index.json names {component} {entry[1]!r}")
        config = root / component / "config.json"
        if config.is_file():
            name = _read_json(config).get("_class_name")
            if name is not None and name not in classes:
                wrong.append(f"{component}/config.json is a {name!r}")
    if wrong:
        wanted = "; ".join(f"{c}: {' or '.join(v)}" for c, v in expected.items())
        raise ValueError(f"{root} ({pipeline}): {', '.join(wrong)}; a {pipeline} needs {wanted}")


def _diffusers(root: Path) -> ModelFolder:
    index = _read_json(root / "model_index.json")
    name = index.get("_class_name")
    if name not in _DIFFUSERS_PIPELINES:
        raise ValueError(
            f"{root}/model_index.json describes a {name!r}; jaxdit runs {', '.join(sorted(_DIFFUSERS_PIPELINES))}"
        )
    kind, needed = _DIFFUSERS_PIPELINES[name]
    if index.get("transformer_2") not in (None, [None, None]):
        raise ValueError(f"{root} is a two-transformer (Wan 2.2) pipeline; jaxdit runs Wan 2.1")
    missing = []
    for component in needed:
        if index.get(component) in (None, [None, None]):
            missing.append(f"{component} (null in model_index.json)")
        elif not (root / component).is_dir():
            missing.append(f"{component}/")
    if missing:
        raise ValueError(f"{root} ({name}) is missing: {', '.join(missing)}")
    check_component_classes(root, index, _COMPONENT_CLASSES[name], name)
    scheduler = _read_json(root / "scheduler" / "scheduler_config.json")
    return ModelFolder(root, kind, "diffusers", {c: root / c for c in needed}, scheduler)


def _wan_original(root: Path) -> ModelFolder:
    components = {
        "transformer": root,
        "vae": root / WAN_ORIGINAL_VAE,
        "text_encoder": root / WAN_ORIGINAL_T5,
        "tokenizer": root / WAN_ORIGINAL_TOKENIZER,
    }
    missing = [
        str(p.relative_to(root)) for name, p in components.items() if name != "transformer" and not p.exists()
    ]
    if missing:
        raise ValueError(
            f"{root} looks like Wan's original release folder but is missing: {', '.join(missing)}"
        )
    config = _read_json(root / "config.json")
    if config.get("model_type") == "i2v" or (root / WAN_ORIGINAL_CLIP).exists():
        raise ValueError(
            f"{root} is Wan's original image-to-video release; its CLIP image encoder ({WAN_ORIGINAL_CLIP}, "
            "open-clip layout) is not supported: use the diffusers folder (Wan-AI/Wan2.1-I2V-14B-*-Diffusers)"
        )
    return ModelFolder(root, WAN_T2V, "wan-original", components)


def open_model_folder(path: str | os.PathLike[str]) -> ModelFolder:
    """Find out what ``path`` holds (see the module docstring); raises ``ValueError`` naming what is wrong."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{root} is not a folder (a downloaded diffusers pipeline or Wan release folder)")
    if (root / "model_index.json").is_file():
        return _diffusers(root)
    if (root / WAN_ORIGINAL_VAE).exists() or (root / WAN_ORIGINAL_T5).exists():
        return _wan_original(root)
    if (root / "config.json").is_file() and not (root / "vae").exists():
        raise ValueError(
            f"{root} holds a single model (config.json) but no pipeline: a prompt needs the text encoders and "
            "the VAE too; pass the pipeline folder (with model_index.json), or prompt embeddings and latents"
        )
    raise ValueError(
        f"{root} is neither a diffusers pipeline folder (no model_index.json) nor Wan's original release "
        f"folder (no {WAN_ORIGINAL_VAE} / {WAN_ORIGINAL_T5})"
    )
