"""No code-executing deserializer anywhere on the wire: not imported by the transfer and worker
modules nor the message codecs, and not called (by any name, from any thread) while KV moves
between two workers. The runtime guard first proves, path by path, that it catches each one."""

from __future__ import annotations

import _pickle
import ast
import importlib
import io
import json
import marshal
import pickle
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import torch

import pdserve
from tests import backends
from tests.kv_transfer.deserializer_guard import DeserializerGuard

FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
WIRE_PACKAGES = ["kv_transfer", "worker"]
WIRE_MODULES = ["wire.py", "http_protocol.py"]  # the messages every worker and router decodes


def wire_sources():
    root = Path(pdserve.__file__).parent
    return [p for pkg in WIRE_PACKAGES for p in sorted((root / pkg).glob("*.py"))] + [root / m for m in WIRE_MODULES]


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


class _Reduced:
    """Pickled through copyreg's reconstructor (no __reduce__ of its own)."""

    def __init__(self) -> None:
        self.x = 1


_early_loads = pickle.loads  # an alias taken before any guard is armed


def _torch_bytes(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


# each way to deserialize something that can run code, and what the guard must name
PATHS = {
    "pickle.loads": (lambda: pickle.loads(pickle.dumps([1, 2])), "_pickle.loads"),
    "pickle.load": (lambda: pickle.load(io.BytesIO(pickle.dumps({"a": 1}))), "_pickle.load"),
    "pickle.Unpickler": (lambda: pickle.Unpickler(io.BytesIO(pickle.dumps(3))).load(), "Unpickler.load"),
    "pickle._Unpickler": (lambda: pickle._Unpickler(io.BytesIO(pickle.dumps(3))).load(), "pickle._Unpickler.load"),
    "_pickle.loads": (lambda: _pickle.loads(pickle.dumps("s")), "_pickle.loads"),
    "an alias from before": (lambda: _early_loads(pickle.dumps(1.5)), "_pickle.loads"),
    "a subclass": (lambda: type("Sub", (pickle.Unpickler,), {})(io.BytesIO(pickle.dumps(1))).load(), "Sub.load"),
    "copyreg": (lambda: pickle.loads(pickle.dumps(_Reduced(), protocol=1)), "pickle.find_class"),
    "marshal.loads": (lambda: marshal.loads(marshal.dumps((1, "a"))), "marshal.loads"),
    "marshal.load": (lambda: marshal.load(io.BytesIO(marshal.dumps(1))), "marshal.load"),
    "torch.load": (lambda: torch.load(_torch_bytes(torch.ones(2)), weights_only=False), "torch.load"),
    "torch.load weights_only": (lambda: torch.load(_torch_bytes({"t": torch.ones(2)}), weights_only=True),
                                "torch weights-only"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["this thread", "a thread started while armed"])
def test_the_guard_sees_every_deserializer(path, where):
    """The positive control: the guard below is only as good as what it catches."""
    run, name = PATHS[path]
    with DeserializerGuard() as guard:
        if where == "this thread":
            run()
        else:
            t = threading.Thread(target=run)
            t.start()
            t.join(30)
            assert not t.is_alive()
    assert any(name in call for call in guard.calls), guard.calls


def test_the_guard_sees_classes_and_marshal_in_threads_started_before_it():
    go, done = threading.Event(), threading.Event()

    def run():
        go.wait(30)
        pickle.loads(pickle.dumps(_Reduced()))
        marshal.loads(marshal.dumps(1))
        done.set()
    t = threading.Thread(target=run)
    t.start()
    with DeserializerGuard() as guard:
        go.set()
        assert done.wait(30)
    t.join(30)
    assert not t.is_alive()
    assert [c.split("(")[0] for c in guard.calls] == ["pickle.find_class", "marshal.loads"]


def test_the_guard_passes_json_msgspec_and_imports():
    sys.modules.pop("colorsys", None)
    with DeserializerGuard() as guard:
        importlib.import_module("colorsys")  # its cached bytecode is read with marshal
        json.loads('{"a": [1, 2]}')
        msgspec.json.decode(b'{"a": 1}')
        msgspec.msgpack.decode(msgspec.msgpack.encode({"a": 1}))
    assert guard.calls == []


@pytest.mark.parametrize("backend", backends.cases(backends.TRANSFER))
def test_a_transfer_never_unpickles(tiny_llama, backend):
    from tests.worker.cluster import Cluster, prompt

    # armed before the workers start, so that every thread they start is watched
    with DeserializerGuard() as guard, Cluster(tiny_llama, backend) as c:
        c.generate(prompt(5))  # the connections open; a lease and its KV go over them once
        guard.calls.clear()  # from here on, only traffic
        tokens, last = c.generate(prompt(37))
        assert len(tokens) == 8 and c.d.worker.stats().kv_landed == 2
        assert guard.calls == [], "something deserialized with pickle, marshal or torch.load during a KV transfer"
