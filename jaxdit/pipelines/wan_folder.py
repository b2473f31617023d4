"""Downloaded Wan folders (2.1 and 2.2), diffusers or Wan-AI's original layout, and the variant each holds.

Kinds (``ModelFolder.kind``):

- ``wan-t2v`` / ``wan-i2v``: Wan 2.1 (one transformer; I2V with its CLIP image encoder);
- ``wan2.2-t2v`` / ``wan2.2-i2v``: Wan 2.2 A14B, two experts (``transformer`` high-noise, ``transformer_2``
  low-noise) switched at ``boundary_ratio``; I2V without a CLIP image encoder;
- ``wan2.2-ti2v``: Wan 2.2 TI2V-5B (``expand_timesteps``: per-token timesteps; text-to-video, or
  image-to-video when given a first frame), with the Wan 2.2 VAE.

diffusers layouts (``model_index.json``): Wan 2.2's are ``WanPipeline`` / ``WanImageToVideoPipeline`` with
``transformer_2``, ``boundary_ratio`` and ``expand_timesteps`` in the index (diffusers
``pipelines/wan/pipeline_wan.py``). Wan-AI's original releases: the umT5 ``.pth``, ``google/umt5-xxl/``
and the VAE ``.pth`` at the root, and the transformer either at the root (``config.json`` + safetensors:
Wan 2.1, TI2V-5B) or as ``high_noise_model/`` + ``low_noise_model/`` (A14B). The original folders hold no
scheduler or pipeline settings; the Wan2.2 repository's ``wan/configs/wan_*.py`` fix them (boundary
0.875 / 0.900, sample_shift 12 / 5 / 5), and :func:`open_original_folder` writes them into the
``ModelFolder`` as a diffusers folder would have them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from converters.wan import CHECKPOINTS, ORIGINAL_EXPERT_DIRS
from jaxdit.loading import checkpoint_config
from jaxdit.pipelines.model_folder import (
    FolderClass,
    ModelFolder,
    is_listed,
    open_diffusers_folder,
    read_json,
)

__all__ = [
    "FOLDER_CLASSES",
    "ORIGINAL_CLIP",
    "ORIGINAL_T5",
    "ORIGINAL_TOKENIZER",
    "ORIGINAL_VAE",
    "ORIGINAL_VAE_22",
    "PRESET_VARIANTS",
    "WanVariant",
    "check_folder",
    "checkpoint_experts",
    "open_folder",
    "open_original_folder",
]

#: Wan's original release: what the folder holds besides the transformer.
ORIGINAL_VAE = "Wan2.1_VAE.pth"
ORIGINAL_VAE_22 = "Wan2.2_VAE.pth"  # TI2V-5B's (A14B uses Wan 2.1's VAE)
ORIGINAL_T5 = "models_t5_umt5-xxl-enc-bf16.pth"
ORIGINAL_TOKENIZER = "google/umt5-xxl"
ORIGINAL_CLIP = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
#: The A14B releases' expert folders.
HIGH_NOISE_DIR, LOW_NOISE_DIR = ORIGINAL_EXPERT_DIRS

#: The Wan2.2 repository's settings of each original release (wan/configs/wan_*.py): the expert boundary,
#: the flow shift (``sample_shift``) and frames per second, by the transformer's ``model_type``.
ORIGINAL_22 = {
    "t2v": dict(kind="wan2.2-t2v", boundary_ratio=0.875, flow_shift=12.0),
    "i2v": dict(kind="wan2.2-i2v", boundary_ratio=0.900, flow_shift=5.0),
    "ti2v": dict(kind="wan2.2-ti2v", expand_timesteps=True, flow_shift=5.0),
}


@dataclasses.dataclass(frozen=True)
class WanVariant:
    """The pipeline-level settings of a Wan folder (``model_index.json``'s, as diffusers names them).

    ``boundary_ratio``: two experts, the high-noise one while t >= boundary_ratio x num_train_timesteps.
    ``expand_timesteps``: TI2V's per-token timesteps (and first-frame conditioning).
    """

    boundary_ratio: float | None = None
    expand_timesteps: bool = False

    @classmethod
    def of(cls, folder: ModelFolder) -> WanVariant:
        index = folder.index
        ratio = index.get("boundary_ratio")
        return cls(None if ratio is None else float(ratio), bool(index.get("expand_timesteps") or False))

    @property
    def fps(self) -> int:
        """Frames per second of the variant's videos: TI2V-5B is trained at 24, the others at 16."""
        return 24 if self.expand_timesteps else 16


#: The pipeline settings of the Wan 2.2 presets (diffusers' model_index.json values of the releases), for
#: a transformer checkpoint loaded without its pipeline folder.
PRESET_VARIANTS = {
    "wan2.2-t2v-a14b": WanVariant(boundary_ratio=ORIGINAL_22["t2v"]["boundary_ratio"]),
    "wan2.2-i2v-a14b": WanVariant(boundary_ratio=ORIGINAL_22["i2v"]["boundary_ratio"]),
    "wan2.2-ti2v-5b": WanVariant(expand_timesteps=True),
}


def _diffusers_kind(index: Mapping[str, Any]) -> str:
    """A Wan pipeline class's kind from its ``model_index.json`` (see the module docstring)."""
    if index.get("expand_timesteps"):
        return "wan2.2-ti2v"
    two = index.get("boundary_ratio") is not None or is_listed(index, "transformer_2")
    image = index.get("_class_name") == "WanImageToVideoPipeline"
    return ("wan2.2-" if two else "wan-") + ("i2v" if image else "t2v")


_T2V_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
_CLASSES = {
    "transformer": ("WanTransformer3DModel",),
    "transformer_2": ("WanTransformer3DModel",),
    "vae": ("AutoencoderKLWan",),
}
#: The diffusers pipeline classes this module runs from a downloaded folder.
FOLDER_CLASSES = {
    "WanPipeline": FolderClass(
        "wan",
        "wan-t2v",
        _T2V_COMPONENTS,
        optional=("transformer_2",),
        variant=_diffusers_kind,
        classes=_CLASSES,
    ),
    "WanImageToVideoPipeline": FolderClass(
        "wan",
        "wan-i2v",
        _T2V_COMPONENTS,
        # Wan 2.1 I2V needs its CLIP image encoder (check_folder); Wan 2.2's I2V and TI2V have none.
        optional=("image_encoder", "image_processor", "transformer_2"),
        takes_image=True,  # TI2V's image is optional: WanFamily.image_input says so
        variant=_diffusers_kind,
        classes=_CLASSES,
    ),
}


def _missing(root: Path, paths: Mapping[str, Path]) -> list[str]:
    return [str(p.relative_to(root)) for p in paths.values() if not p.exists()]


def _original_22(root: Path) -> ModelFolder | None:
    """Wan 2.2's original releases: A14B (expert folders) or TI2V-5B (the Wan 2.2 VAE); else None."""
    experts = (root / HIGH_NOISE_DIR).exists() or (root / LOW_NOISE_DIR).exists()
    if not experts and not (root / ORIGINAL_VAE_22).exists():
        return None
    common = {"text_encoder": root / ORIGINAL_T5, "tokenizer": root / ORIGINAL_TOKENIZER}
    if experts and not any(p.exists() for p in (root / ORIGINAL_VAE, *common.values())):
        return None  # the two experts alone (e.g. each converted by jaxdit convert): a checkpoint folder
    if experts:
        paths = {
            "transformer": root / HIGH_NOISE_DIR,
            "transformer_2": root / LOW_NOISE_DIR,
            "vae": root / ORIGINAL_VAE,
            **common,
        }
        config = root / HIGH_NOISE_DIR / "config.json"
    else:
        paths = {"transformer": root, "vae": root / ORIGINAL_VAE_22, **common}
        config = root / "config.json"
    missing = _missing(root, paths) + ([] if config.exists() else [str(config.relative_to(root))])
    if missing:
        raise ValueError(
            f"{root} looks like Wan 2.2's original release folder but is missing: {', '.join(missing)}"
        )
    model_type = read_json(config).get("model_type", "t2v")
    if experts == (model_type == "ti2v") or model_type not in ORIGINAL_22:
        layout = "expert folders" if experts else f"{ORIGINAL_VAE_22} and one transformer"
        raise ValueError(
            f"{config}: model_type {model_type!r} with {layout}: Wan 2.2's original releases are A14B "
            f"(t2v / i2v, {HIGH_NOISE_DIR}/ + {LOW_NOISE_DIR}/) and TI2V-5B (ti2v, {ORIGINAL_VAE_22})"
        )
    settings = dict(ORIGINAL_22[model_type])
    kind, flow_shift = settings.pop("kind"), settings.pop("flow_shift")
    scheduler = {
        "_class_name": "UniPCMultistepScheduler",
        "prediction_type": "flow_prediction",
        "use_flow_sigmas": True,
        "num_train_timesteps": 1000,
        "flow_shift": flow_shift,
    }
    takes_image = kind == "wan2.2-i2v"  # TI2V's image is optional (WanFamily.image_input)
    return ModelFolder(root, "wan", kind, "wan-original", paths, scheduler, settings, takes_image)


def open_original_folder(root: Path) -> ModelFolder | None:
    """Wan's original release folder (``Wan-AI/Wan2.1-T2V-14B``, ``Wan-AI/Wan2.2-T2V-A14B``,
    ``Wan-AI/Wan2.2-TI2V-5B`` and the like; see the module docstring); None if ``root`` is not one."""
    folder = _original_22(root)
    if folder is not None:
        return folder
    if not ((root / ORIGINAL_VAE).exists() or (root / ORIGINAL_T5).exists()):
        return None
    components = {
        "transformer": root,
        "vae": root / ORIGINAL_VAE,
        "text_encoder": root / ORIGINAL_T5,
        "tokenizer": root / ORIGINAL_TOKENIZER,
    }
    missing = _missing(root, {k: v for k, v in components.items() if k != "transformer"})
    if missing:
        raise ValueError(
            f"{root} looks like Wan's original release folder but is missing: {', '.join(missing)}"
        )
    config = read_json(root / "config.json")
    if config.get("model_type") == "i2v" or (root / ORIGINAL_CLIP).exists():
        raise ValueError(
            f"{root} is Wan's original image-to-video release; its CLIP image encoder ({ORIGINAL_CLIP}, "
            "open-clip layout) is not supported: use the diffusers folder (Wan-AI/Wan2.1-I2V-14B-*-Diffusers)"
        )
    return ModelFolder(root, "wan", "wan-t2v", "wan-original", components)


def check_folder(folder: ModelFolder) -> None:
    """What the folder recognition cannot see from the class name: the variant's components agree."""
    root = folder.root
    variant = WanVariant.of(folder)
    two = "transformer_2" in folder
    if variant.boundary_ratio is not None and not two:
        raise ValueError(
            f"{root}: boundary_ratio {variant.boundary_ratio} switches to a low-noise expert, but the folder has "
            "no transformer_2 (a Wan 2.2 A14B pipeline has both transformers)"
        )
    if two and variant.boundary_ratio is None:
        raise ValueError(
            f"{root} has a transformer_2 but no boundary_ratio in model_index.json: diffusers would never run "
            "it (Wan 2.2 A14B pipelines set 0.875 for T2V, 0.9 for I2V)"
        )
    if variant.boundary_ratio is not None and not 0.0 < variant.boundary_ratio < 1.0:
        raise ValueError(f"{root}: boundary_ratio must lie in (0, 1), got {variant.boundary_ratio}")
    if variant.expand_timesteps and two:
        raise ValueError(f"{root}: expand_timesteps (TI2V) with two experts is no Wan 2.2 release")
    if folder.kind == "wan-i2v":
        # Listed components whose folder is absent were reported by open_diffusers_folder: these are null.
        missing = [
            f"{c} (null in model_index.json)" for c in ("image_encoder", "image_processor") if c not in folder
        ]
        if missing:
            raise ValueError(
                f"{root} (WanImageToVideoPipeline) is missing: {', '.join(missing)}; Wan 2.1 I2V (no "
                "boundary_ratio, no expand_timesteps) reads CLIP image features"
            )


def open_folder(path: str | os.PathLike[str]) -> ModelFolder:
    """A Wan folder in the diffusers or the original layout (see the module docstring)."""
    root = Path(path)
    folder = open_original_folder(root) if not (root / "model_index.json").is_file() else None
    if folder is None:
        folder = open_diffusers_folder(root, FOLDER_CLASSES)
    check_folder(folder)
    return folder


def _a14b_kind(expert: Path) -> str:
    """t2v or i2v, which sets the expert switch: the original config's ``model_type``; a diffusers or
    ``jaxdit convert`` folder records none, and its input channels tell (I2V: mask + image latent)."""
    config = expert / "config.json"
    if config.is_file() and "model_type" in (data := read_json(config)):
        return data["model_type"]
    return "i2v" if checkpoint_config(expert, CHECKPOINTS).condition_channels else "t2v"


def checkpoint_experts(path: Path, preset: str | None = None) -> tuple[tuple[Path, ...], WanVariant]:
    """The transformer checkpoint(s) under ``path`` (``WanPipeline.from_checkpoint``) and the pipeline
    settings they come with: a Wan 2.2 A14B folder holds two experts (``high_noise_model/`` +
    ``low_noise_model/``, or a diffusers pipeline's ``transformer/`` + ``transformer_2/``), anything else
    one (``path`` itself: the checkpoint readers find a pipeline's ``transformer/``). ``preset``: a Wan
    2.2 preset's settings where the checkpoint carries none."""
    variant = PRESET_VARIANTS.get(preset or "", WanVariant())
    if (path / HIGH_NOISE_DIR).exists() or (path / LOW_NOISE_DIR).exists():
        paths = (path / HIGH_NOISE_DIR, path / LOW_NOISE_DIR)
        missing = [p.name for p in paths if not p.is_dir()]
        if missing:
            raise ValueError(
                f"{path}: a Wan 2.2 A14B folder holds {HIGH_NOISE_DIR}/ and {LOW_NOISE_DIR}/; no {missing[0]}/"
            )
        model_type = _a14b_kind(paths[0])
        if model_type not in ("t2v", "i2v"):
            raise ValueError(f"{paths[0]}: model_type {model_type!r} in an A14B expert folder (t2v or i2v)")
        return paths, WanVariant(boundary_ratio=ORIGINAL_22[model_type]["boundary_ratio"])
    if (path / "model_index.json").is_file():
        index = read_json(path / "model_index.json")
        found = WanVariant(
            None if index.get("boundary_ratio") is None else float(index["boundary_ratio"]),
            bool(index.get("expand_timesteps") or False),
        )
        if is_listed(index, "transformer_2"):
            if found.boundary_ratio is None:
                raise ValueError(f"{path}: transformer_2 without a boundary_ratio in model_index.json")
            return (path / "transformer", path / "transformer_2"), found
        return (path,), found if found != WanVariant() else variant
    if variant.boundary_ratio is not None:
        raise ValueError(
            f"{preset} has two experts: give the folder holding both ({HIGH_NOISE_DIR}/ + {LOW_NOISE_DIR}/, "
            f"or a diffusers pipeline with transformer/ + transformer_2/), not {path}"
        )
    return (path,), variant
