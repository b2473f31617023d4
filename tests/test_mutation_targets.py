"""scripts/mutation_check.py plants each mistake by replacing a line of the library: a refactor that moves
that line leaves the mutation stale (it then tests nothing). Cheap to check here; the mutations themselves
take minutes and run by hand."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutations():
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.MUTATIONS


@pytest.mark.parametrize("mutation", _mutations(), ids=lambda m: m.name)
def test_each_mutation_still_has_its_line_and_its_tests(mutation):
    assert (ROOT / mutation.file).read_text().count(mutation.old) == 1, f"{mutation.name} is stale"
    for node in mutation.tests:
        path, _, name = node.partition("::")  # a file, or a file's test (parameters in brackets)
        text = (ROOT / path).read_text()
        assert not name or f"def {name.split('[')[0]}(" in text, f"{mutation.name}: no test {node}"
