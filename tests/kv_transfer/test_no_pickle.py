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
import socket
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import torch

import pdserve
from pdserve.kv_transfer.codec import MAGIC, PREFIX, VERSION, FrameError, FrameKind, FrameLimits, read_frame
from tests import backends
from tests.kv_transfer.deserializer_guard import DeserializerGuard

FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
WIRE_PACKAGES = ["kv_transfer", "worker"]
WIRE_MODULES = ["wire.py", "http_protocol.py"]  # the messages every worker and router decodes


def wire_sources():
    root = Path(pdserve.__file__).parent
    return [p for pkg in WIRE_PACKAGES for p in sorted((root / pkg).glob("*.py"))] + [root / m for m in WIRE_MODULES]


DESERIALIZING_ATTRS = ("load", "loads", "deserialize_descs", "get_serialized_descs")  # torch.load, NIXL's descs


def deserializer_uses(source: str) -> list[str]:
    """What in `source` imports a code-executing deserializer or reaches one by a name built at
    run time: an import of a forbidden module, a call of a deserializing attribute (but json's and
    msgpack's), `__import__(...)`, `importlib.import_module(...)` and `getattr(x, "loads")`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]]
            if node.module == "importlib" and any(a.name == "import_module" for a in node.names):
                found.append("importlib.import_module")
        found += [f"import {n}" for n in names if n in FORBIDDEN_MODULES]
        if isinstance(node, ast.Attribute):
            owner = getattr(node.value, "attr", getattr(node.value, "id", None))
            if node.attr in DESERIALIZING_ATTRS and owner not in ("json", "msgpack"):
                found.append(f"{owner}.{node.attr}")
            if node.attr == "import_module":
                found.append(f"{owner}.import_module")
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "__import__":
                found.append("__import__")
            if (isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in DESERIALIZING_ATTRS):
                found.append(f"getattr(..., {node.args[1].value!r})")
    return found


@pytest.mark.parametrize("path", wire_sources(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_wire_modules_import_no_deserializer(path):
    assert deserializer_uses(path.read_text()) == [], path.name


@pytest.mark.parametrize("source, named", [
    ("import pickle", "import pickle"),
    ("from marshal import loads", "import marshal"),
    ("torch.load(buf)", "torch.load"),
    ("__import__('pickle').loads(b)", "__import__"),
    ("import importlib\nimportlib.import_module('pickle')", "importlib.import_module"),
    ("from importlib import import_module", "importlib.import_module"),
    ("getattr(module, 'loads')(b)", "getattr(..., 'loads')"),
])
def test_the_scan_names_each_way_to_reach_a_deserializer(source, named):
    assert named in deserializer_uses(source)
    assert deserializer_uses("json.loads(s); msgpack.loads(b); getattr(x, 'size')") == []


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


@pytest.mark.parametrize("kind", list(FrameKind), ids=lambda k: k.name)
def test_a_kv_header_in_a_code_executing_format_is_refused_unread(kind):
    """A frame whose header is a pickle (one that would run code if unpickled) is refused as a
    malformed frame, and nothing deserializes it on the way."""
    class Runs:
        def __reduce__(self):
            return (print, ("this must never run",))

    header = pickle.dumps({"request_id": "r", "run": Runs()})
    frame = PREFIX.pack(MAGIC, VERSION, kind, 0, len(header), 0) + header
    a, b = socket.socketpair()
    with a, b, DeserializerGuard() as guard:
        a.sendall(frame)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError):
            read_frame(b, FrameLimits(max_header_bytes=4096, max_payload_bytes=1 << 20),
                       lambda h, n: [memoryview(bytearray(n))])
    assert guard.calls == []
