"""The package's layers, checked: each rule fails the moment an import crosses it.

- `engine/` computes: it imports no network code and nothing of the processes built on it.
- `models/` and `layers/` are the model: nothing of the engine or above.
- `router/` and the modules it shares with workers (wire, errors, prefix hashing, detokenizer,
  structures) need no torch: the router's process never loads it (checked in a real process, not
  only by reading).
- `on_ray/` places processes: it starts workers by their command line and imports none of them.
- `wire.py` is the vocabulary between processes: it depends on nothing of theirs.
- `limits.py` is every bound a request may carry, for every tier: it imports nothing of pdserve.
- `kv_transfer/` moves KV between workers: nothing of the worker, router, benchmarks or tools.
- `worker/` serves an engine: nothing of the router (their common words are `wire.py`) or the tools.
- `workload/` is the benchmarks' and the simulator's common vocabulary (lengths, records, results,
  plots): nothing of either, nor of the engine, the model or the servers.
- `telemetry/` is what an operator sees of a running cluster (traces, the dashboard, `pdserve
  top`): the servers import its tracer, and it imports nothing of them, the engine or torch
  (`pdserve top` starts in a fraction of a second, anywhere).
- `bench/` measures and `sim/` simulates; neither imports the other, and the simulator starts no
  server of its own.
- Between the package's parts (its subpackages and top-level modules) the imports form no circle,
  nor between its modules: an import under `TYPE_CHECKING` or inside a function counts too (a
  circle held together by either is still one module that cannot be read without the other).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pdserve"

NETWORK = ("httpx", "fastapi", "starlette", "uvicorn", "socket", "pdserve.net", "pdserve.http_")
ABOVE_ENGINE = ("pdserve.worker", "pdserve.router", "pdserve.kv_transfer", "pdserve.launcher", "pdserve.bench",
                "pdserve.sim", "pdserve.on_ray")
RULES = {
    "engine": NETWORK + ABOVE_ENGINE,
    "models": NETWORK + ABOVE_ENGINE + ("pdserve.engine",),
    "layers": NETWORK + ABOVE_ENGINE + ("pdserve.engine", "pdserve.models"),
    "router": ("torch", "pdserve.engine", "pdserve.worker", "pdserve.kv_transfer", "pdserve.layers", "pdserve.llm"),
    "on_ray": ("torch", "pdserve.engine", "pdserve.kv_transfer", "pdserve.layers", "pdserve.models", "pdserve.llm",
               "pdserve.worker"),
    "kv_transfer": ("pdserve.engine", "pdserve.worker", "pdserve.router", "pdserve.bench", "pdserve.sim",
                    "pdserve.on_ray", "pdserve.launcher", "pdserve.workload"),
    "worker": ("pdserve.router", "pdserve.bench", "pdserve.sim", "pdserve.on_ray", "pdserve.launcher",
               "pdserve.workload"),
    "workload": NETWORK + ABOVE_ENGINE + ("torch", "pdserve.engine", "pdserve.models", "pdserve.layers"),
    "telemetry": ("torch", "pdserve.engine", "pdserve.models", "pdserve.layers", "pdserve.llm", "pdserve.router",
                  "pdserve.worker", "pdserve.kv_transfer", "pdserve.launcher", "pdserve.on_ray"),
    "bench": ("pdserve.sim", "pdserve.on_ray"),
    "sim": ("pdserve.bench", "pdserve.worker", "pdserve.on_ray", "httpx", "fastapi", "uvicorn"),
    "wire.py": ("torch", "fastapi", "httpx", "pdserve.engine", "pdserve.worker", "pdserve.router", "pdserve.kv_transfer"),
    "limits.py": ("torch", "pdserve.engine", "pdserve.worker", "pdserve.router", "pdserve.kv_transfer",
                  "pdserve.sampling_params", "pdserve.wire", "pdserve.config"),
    "cache.py": ("torch", "pdserve.engine", "pdserve.models", "pdserve.layers", "pdserve.worker", "pdserve.router"),
    "errors.py": ("torch", "pdserve.engine", "pdserve.worker", "pdserve.router", "pdserve.kv_transfer"),
    "prefix_hash.py": ("torch", "pdserve.engine"),
    "structure.py": ("torch", "numpy", "pdserve.engine", "pdserve.models", "pdserve.layers"),
    "detokenizer.py": ("torch", "pdserve.engine"),
}


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of the file (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def crossings(layer: str) -> list[str]:
    root = PACKAGE / layer
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    banned = RULES[layer]
    return [f"{path.relative_to(PACKAGE)} imports {name}" for path in files for name in sorted(imports(path))
            if any(name == b or name.startswith(b if b.endswith("_") else b + ".") for b in banned)]


@pytest.mark.parametrize("layer", sorted(RULES))
def test_no_import_crosses_a_layer(layer):
    assert crossings(layer) == []


def part_graph(package: Path) -> dict[str, set[str]]:
    """Which of the package's parts (subpackages and top-level modules) each part imports."""
    def part(module: str) -> str | None:
        name = module.split(".")[1] if module.startswith("pdserve.") else None
        return name if name and ((package / name).is_dir() or (package / f"{name}.py").is_file()) else None

    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(package)
        here = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        targets = {part(m) for m in imports(path)} - {None, here}
        graph.setdefault(here, set()).update(targets)
    return graph


def module_graph(package: Path) -> dict[str, set[str]]:
    """Which of the package's modules each module imports (a package's `__init__` is not counted:
    every one of them is empty)."""
    modules = {".".join(p.relative_to(package.parent).with_suffix("").parts): p for p in package.rglob("*.py")
               if p.name != "__init__.py"}

    def module(name: str) -> str | None:  # `from pdserve.a import b`: the module b, or a if b is a name in it
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {name: {module(m) for m in imports(path)} - {None, name} for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle as the path that closes it, found by depth-first search."""
    found, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_package_has_no_import_circle():
    assert circles(part_graph(PACKAGE)) == []


def test_no_module_imports_itself_through_others():
    assert circles(module_graph(PACKAGE)) == []


def test_a_circle_through_type_checking_is_found(tmp_path):
    package = tmp_path / "pdserve"
    (package / "router").mkdir(parents=True)
    (package / "router" / "app.py").write_text("from pdserve.router.rounds import reap\n")
    (package / "router" / "rounds.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pdserve.router.app import Router\n")
    assert circles(module_graph(package)) == [["pdserve.router.app", "pdserve.router.rounds", "pdserve.router.app"]]


def test_a_circle_is_found():
    assert circles({"layers": {"models"}, "models": {"layers", "tokenizer"}, "tokenizer": set()}) == [
        ["layers", "models", "layers"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_rules_catch_a_crossing(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "step.py").write_text("def f():\n    from pdserve.router.app import Router\n    import httpx\n")
    assert crossings("engine") == ["engine/step.py imports httpx", "engine/step.py imports pdserve.router.app",
                                   "engine/step.py imports pdserve.router.app.Router"]


def test_the_router_process_never_loads_torch(tiny_llama):
    """What `pdserve router` runs, up to a router ready to serve, in a fresh interpreter."""
    script = (
        "import sys\n"
        "from pdserve.cli import build_parser\n"
        "from pdserve.router.main import build_router\n"
        "from pdserve.router.app import create_app\n"
        f"args = build_parser().parse_args(['router', '--model', {str(tiny_llama)!r}])\n"
        "create_app(build_router(args, token='t'))\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(len(loaded), loaded[:5])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("0 "), out.stdout
