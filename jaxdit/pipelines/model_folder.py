"""What a downloaded model folder holds, found and checked before anything is read.

A diffusers pipeline folder as ``save_pretrained`` / the hub writes it has ``model_index.json`` naming
the pipeline class and one sub-folder per component (``transformer/``, ``vae/``, ``text_encoder/``,
``tokenizer/``, ``scheduler/``, ...). Each family's pipeline module declares the classes it runs
(:class:`FolderClass`: the variant and the components it must have) and, where the model ships in a
layout of its own (Wan's original release), a function that recognises it; ``jaxdit.families`` asks
every registered family. :func:`open_diffusers_folder` returns a :class:`ModelFolder` naming every
component's path, or raises one ``ValueError`` that lists everything missing, so a half-downloaded folder
fails in a second, not after the transformer has been read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "FolderClass",
    "ModelFolder",
    "check_component_classes",
    "is_listed",
    "open_diffusers_folder",
    "read_json",
]


@dataclasses.dataclass(frozen=True)
class FolderClass:
    """A diffusers pipeline class a family runs: which family and variant, and the components it needs.

    ``optional``: components the class may have (null or absent is fine), e.g. Wan 2.2's ``transformer_2``.
    ``variant``: for a class that holds several variants, the kind read from ``model_index.json`` (Wan
    2.2's ``WanPipeline`` is two-expert T2V with a ``boundary_ratio``, TI2V with ``expand_timesteps``).
    """

    family: str
    kind: str  # the variant, named in messages: "flux", "wan-t2v", "wan-i2v", ...
    components: tuple[str, ...]
    optional: tuple[str, ...] = ()
    takes_image: bool = False  # image-to-video: a call needs a first frame
    #: component -> the model classes jaxdit reads for it (a transformer of another family would load
    #: into the wrong model, or fail halfway through a long read).
    classes: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    variant: Callable[[Mapping[str, Any]], str] | None = None


@dataclasses.dataclass(frozen=True)
class ModelFolder:
    """A checked model folder: its family, kind, layout and where each component lives.

    ``components`` maps a diffusers component name (``transformer``, ``vae``, ``text_encoder``, ...) to a
    path: a sub-folder for the diffusers layout, a file or folder for a family's own layout.
    ``scheduler_config`` is the folder's ``scheduler/scheduler_config.json`` (None where the layout has
    none: the sampler's defaults apply); ``index`` the parsed ``model_index.json`` (pipeline-level
    settings such as Wan 2.2's ``boundary_ratio``).
    """

    root: Path
    family: str
    kind: str
    layout: str  # "diffusers" or the family's own layout name (e.g. "wan-original")
    components: dict[str, Path]
    scheduler_config: dict[str, Any] | None = None
    index: dict[str, Any] = dataclasses.field(default_factory=dict)
    takes_image: bool = False  # image-to-video: a call needs a first frame

    def __getitem__(self, component: str) -> Path:
        return self.components[component]

    def __contains__(self, component: str) -> bool:
        return component in self.components


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A folder's JSON file, or a ValueError naming the file (missing, unreadable or not JSON)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def is_listed(index: Mapping[str, Any], component: str) -> bool:
    """Whether ``model_index.json`` lists ``component`` (diffusers writes [null, null] for absent ones)."""
    return index.get(component) not in (None, [None, None])


def check_component_classes(
    root: Path, index: Mapping[str, Any], expected: Mapping[str, tuple[str, ...]], pipeline: str = "pipeline"
) -> None:
    """Each component's class, as ``model_index.json`` names it (``[library, class]``) and as its
    ``config.json`` ``_class_name`` says, must be one of ``expected[component]``; raises one ValueError
    listing every mismatch. Components not in ``expected``, and files that do not say, are not checked."""
    wrong = []
    for component, classes in expected.items():
        entry = index.get(component)
        listed = isinstance(entry, list) and len(entry) == 2 and entry[1] is not None  # null: absent
        if listed and entry[1] not in classes:
            wrong.append(f"model_index.json names {component} {entry[1]!r}")
        config = root / component / "config.json"
        if config.is_file():
            name = read_json(config).get("_class_name")
            if name is not None and name not in classes:
                wrong.append(f"{component}/config.json is a {name!r}")
    if wrong:
        wanted = "; ".join(f"{c}: {' or '.join(v)}" for c, v in expected.items())
        raise ValueError(f"{root} ({pipeline}): {', '.join(wrong)}; a {pipeline} needs {wanted}")


def open_diffusers_folder(root: Path, classes: Mapping[str, FolderClass]) -> ModelFolder:
    """A diffusers pipeline folder whose ``model_index.json`` names one of ``classes``."""
    index = read_json(root / "model_index.json")
    name = index.get("_class_name")
    if name not in classes:
        raise ValueError(
            f"{root}/model_index.json describes a {name!r}; jaxdit runs {', '.join(sorted(classes))}"
        )
    spec = classes[name]
    missing = []
    for component in spec.components:
        if not is_listed(index, component):
            missing.append(f"{component} (null in model_index.json)")
        elif not (root / component).is_dir():
            missing.append(f"{component}/")
    present = [c for c in spec.optional if is_listed(index, c)]
    missing += [f"{c}/" for c in present if not (root / c).is_dir()]
    if missing:
        raise ValueError(f"{root} ({name}) is missing: {', '.join(missing)}")
    check_component_classes(root, index, spec.classes, name)
    scheduler = read_json(root / "scheduler" / "scheduler_config.json")
    components = {c: root / c for c in (*spec.components, *present)}
    kind = spec.kind if spec.variant is None else spec.variant(index)
    return ModelFolder(root, spec.family, kind, "diffusers", components, scheduler, index, spec.takes_image)
