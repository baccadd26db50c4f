"""The test suite's own layout: a test module takes what it shares from conftest fixtures and helper
modules (factories, the clusters, `wait_for`), never from another test module, so that each one runs,
moves and is renamed alone."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def imported_names(source: str, package: tuple[str, ...]) -> Iterator[str]:
    """Every dotted name an import in `source` (a module of `package`) may load: the module of each
    `import` and `from ... import`, relative ones resolved, and `from X import Y` as X.Y too (Y may be
    a module). Imports inside functions count as well."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def is_test_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split(".")).with_suffix(".py")
    return path.name.startswith("test_") and path.is_file()


def test_every_form_of_importing_a_test_module_is_seen():
    source = ("import tests.test_layout\n"
              "from tests.test_layout import ROOT\n"
              "from tests import test_layout\n"
              "def f():\n    from ..test_layout import TESTS\n"
              "from tests.wait import wait_for\n"
              "from .cluster import Cluster\n")
    names = list(imported_names(source, ("tests", "worker")))
    assert "tests.worker.cluster" in names  # relative imports resolved from the importing module's package
    assert [n for n in names if is_test_module(n)] == ["tests.test_layout"] * 4


def test_no_test_module_imports_another():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        package = path.relative_to(ROOT).parent.parts
        for name in imported_names(path.read_text(), package):
            if is_test_module(name):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "move what they share into conftest.py or a helper module:\n" + "\n".join(offenders)
