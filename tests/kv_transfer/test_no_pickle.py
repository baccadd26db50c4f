"""No code-executing deserializer anywhere on the wire: not imported by the transfer and worker
modules, and not called while KV moves between two workers."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

import pdserve
from tests import backends

FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
WIRE_PACKAGES = ["kv_transfer", "worker"]


def wire_sources():
    root = Path(pdserve.__file__).parent
    return [p for pkg in WIRE_PACKAGES for p in sorted((root / pkg).glob("*.py"))]


@pytest.mark.parametrize("path", wire_sources(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_wire_modules_import_no_deserializer(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]]
        assert not FORBIDDEN_MODULES & set(names), f"{path.name} imports {names}"
        if isinstance(node, ast.Attribute):
            # torch.load and NIXL's descriptor (de)serializers unpickle
            owner = getattr(node.value, "attr", getattr(node.value, "id", None))
            assert node.attr not in ("load", "deserialize_descs", "get_serialized_descs", "loads") or (
                owner in ("json", "msgpack")
            ), f"{path.name} calls {owner}.{node.attr}"


@pytest.mark.parametrize("backend", backends.cases(backends.TRANSFER))
def test_a_transfer_never_unpickles(tiny_llama, monkeypatch, backend):
    from tests.worker.cluster import Cluster, prompt

    def refuse(*args, **kwargs):
        raise AssertionError("something unpickled during a KV transfer")
    with Cluster(tiny_llama, backend) as c:
        monkeypatch.setattr(pickle, "loads", refuse)
        monkeypatch.setattr(pickle, "load", refuse)
        tokens, last = c.generate(prompt(37))
        assert len(tokens) == 8 and c.d.worker.stats().kv_landed == 1
