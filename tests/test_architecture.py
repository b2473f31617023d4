"""The shape of the house, enforced: imports run one way, without cycles, and families stay in their files.

Layers, lowest first (docs/architecture.md explains each): a module may import only from its own layer or
below. Every import counts, module-level or inside a function, so a function-level import cannot hide a
cycle or an upward dependency. ``jaxdit/__init__.py`` is the public facade on top of everything.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxdit", "converters", "sharding_rules")

#: (module prefix, layer): the longest matching prefix decides.
LAYERS = {
    "sharding_rules": 0,
    "jaxdit.mesh": 1,
    "jaxdit.distributed": 1,
    "jaxdit.runtime": 1,
    "jaxdit.hlo_stats": 1,
    "jaxdit.parallel": 2,
    "jaxdit.models": 3,
    "jaxdit.vae": 3,
    "jaxdit.text_encoders": 3,
    "jaxdit.samplers": 3,
    "jaxdit.cache": 3,
    "converters": 4,
    "jaxdit.loading": 5,
    "jaxdit.lora": 5,
    "jaxdit.pipelines": 6,
    "jaxdit.families": 7,
    "jaxdit.plan": 8,
    "jaxdit.generate": 8,
    "jaxdit.generate_request": 8,
    "jaxdit.generate_checks": 8,
    "jaxdit.generate_cache": 8,
    "jaxdit.serve": 8,
    "jaxdit.cli": 9,
    "jaxdit.cli_help": 9,
    "jaxdit.cli_family_flags": 9,
}
#: The package facade (jaxdit/__init__.py) sits above everything.
FACADE = 10


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def layer(module: str) -> int | None:
    if module == "jaxdit":
        return FACADE
    matches = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(matches, key=len)] if matches else None


def _resolve(name: str) -> str | None:
    """The project module an imported name lives in (a submodule when it is one), else None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> set[str]:
    """Every project module ``module`` imports, at module level or inside functions."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + [base]).strip(".")
            # "from pkg import sub" depends on the submodule; "from mod import name" on the module.
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.add(target)
    return found


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_has_a_layer():
    """A new module must be given a layer here (and in docs/architecture.md) before it can land."""
    missing = sorted(m for m in MODULES if layer(m) is None)
    assert not missing, missing


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_one_way(module):
    upward = sorted(t for t in GRAPH[module] if layer(t) > layer(module))
    assert not upward, f"{module} (layer {layer(module)}) imports from above: {upward}"


def test_no_import_cycles():
    """Tarjan's strongly connected components over every import (function-level ones included)."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    # A package __init__ that re-exports its submodules is not a cycle with them.
    real = [c for c in cycles if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert not real, real


def _registered_names() -> list[str]:
    """Every registered family's name, its folder kinds and presets' stems: what code would branch on."""
    from jaxdit import families

    names = set()
    for family in families.FAMILIES.values():
        names.add(family.name)
        names.update(c.kind for c in family.folder_classes.values())
    return sorted(names, key=len, reverse=True)


NAMES = _registered_names()
#: How a family is named in code that branches on it.
_ALTERNATIVES = "|".join(re.escape(n) for n in NAMES)
FAMILY_BRANCH = re.compile(
    rf"""(==|!=|\bin\b)\s*\(?\s*["']({_ALTERNATIVES})["']|["']({_ALTERNATIVES})["']\s*(==|!=)"""
)
#: A file named after a family (its name as a Python identifier: "tiny-digits" -> tiny_digits).
_FAMILY_STEM = re.compile("|".join(re.escape(n.replace("-", "_")) for n in NAMES))


def _family_files(path: Path) -> bool:
    """A family's own files: named after it, or in jaxdit/families/ (its object)."""
    rel = path.relative_to(ROOT).as_posix()
    return rel.startswith("jaxdit/families/") or _FAMILY_STEM.search(path.stem) is not None


def test_family_names_come_from_the_registry():
    from jaxdit import families

    assert {"flux", "wan", "tiny-digits"} <= set(NAMES)
    assert all(_family_files(MODULES[m]) for m in MODULES if m.startswith("jaxdit.families."))
    assert not _family_files(MODULES["jaxdit.generate"]) and len(families.FAMILIES) >= 3


def test_shared_code_imports_no_family_module():
    """Shared code finds a family through the registry, never by importing the family's own files
    (generate, serve, the CLI, caches, samplers, the loaders)."""
    found = []
    for module, path in MODULES.items():
        if _family_files(path) or module == "jaxdit" or module.startswith("jaxdit.families"):
            continue
        for target in GRAPH[module]:
            registry = target in ("jaxdit.families", "jaxdit.families.base")
            if not registry and (target.startswith("jaxdit.families") or _family_files(MODULES[target])):
                found.append(f"{module} imports {target}")
    assert not found, "\n".join(sorted(found))


def test_family_branches_stay_in_the_families_files():
    """Outside a family's own files, nothing compares against a family's name."""
    found = []
    for path in MODULES.values():
        if _family_files(path):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if FAMILY_BRANCH.search(line.split("#")[0]):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
