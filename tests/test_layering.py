"""The package's layers, checked: each rule fails the moment an import crosses it.

- `engine/` computes: it imports no network code and nothing of the processes built on it.
- `models/` and `layers/` are the model: nothing of the engine or above.
- `router/` and the modules it shares with workers (wire, errors, prefix hashing, detokenizer) need
  no torch: the router's process never loads it (checked in a real process, not only by reading).
- `on_ray/` places processes: it starts workers by their command line and imports none of them.
- `wire.py` is the vocabulary between processes: it depends on nothing of theirs.
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
    "layers": NETWORK + ABOVE_ENGINE + ("pdserve.engine",),
    "router": ("torch", "pdserve.engine", "pdserve.worker", "pdserve.kv_transfer", "pdserve.layers", "pdserve.llm"),
    "on_ray": ("torch", "pdserve.engine", "pdserve.kv_transfer", "pdserve.layers", "pdserve.models", "pdserve.llm",
               "pdserve.worker"),
    "wire.py": ("torch", "fastapi", "httpx", "pdserve.engine", "pdserve.worker", "pdserve.router", "pdserve.kv_transfer"),
    "errors.py": ("torch", "pdserve.engine", "pdserve.worker", "pdserve.router", "pdserve.kv_transfer"),
    "prefix_hash.py": ("torch", "pdserve.engine"),
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
