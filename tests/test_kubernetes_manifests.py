"""deploy/kubernetes, checked without a cluster:

1. Rendered: the base and each overlay, by a small strategic merge here (list items merged by
   `name`, other lists replaced whole, as kustomize does for the fields the overlays patch); where
   kubectl is installed, `kubectl kustomize` renders them too and must agree.
2. Every object read into its Kubernetes API model (the `kubernetes` package's pydantic models,
   extra fields forbidden): an unknown or misspelt field, or a missing required one, fails.
3. Every container's command parsed by pdserve's own parser, after the $(VAR) references the
   kubelet expands: the manifests cannot drift from the CLI. Secrets come from the Secret through
   the environment, never a command line; probes ask /health; ports, drain and router agree.
"""

from __future__ import annotations

import argparse
import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
k8s_models = pytest.importorskip("kubernetes.client.models", reason="the test extra: pip install -e '.[test]'")

from pdserve.cli import build_parser  # noqa: E402
from pdserve.credentials import API_KEY_ENV, TOKEN_ENV  # noqa: E402
from pdserve.router.main import router_secrets  # noqa: E402
from pdserve.worker.main import worker_token  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent.name for p in (ROOT / "overlays").glob("*/kustomization.yaml"))
TARGETS = ["base", *(f"overlays/{name}" for name in OVERLAYS)]
SECRET_NAME = "pdserve"
POD_IP = "10.1.2.3"  # what the downward API would give status.podIP


# -- rendering -------------------------------------------------------------------------------------


def _merge(base, patch):
    """Strategic merge as far as these manifests need it: maps merge, lists of named items merge by
    name (containers, env, ports, volumes), any other list (args, tolerations) is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    named = lambda items: isinstance(items, list) and items and all(isinstance(i, dict) and "name" in i for i in items)
    if named(base) and named(patch):
        out = [copy.deepcopy(i) for i in base]
        for item in patch:
            at = next((k for k, b in enumerate(out) if b["name"] == item["name"]), None)
            if at is None:
                out.append(copy.deepcopy(item))
            else:
                out[at] = _merge(out[at], item)
        return out
    return copy.deepcopy(patch)


def _key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def render(target: str) -> dict[tuple[str, str], dict]:
    """The objects of a kustomization directory, by (kind, name)."""
    directory = ROOT / target
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(spec) <= {"apiVersion", "kind", "resources", "patches"}, f"{target}: render() needs to learn {set(spec)}"
    objects: dict[tuple[str, str], dict] = {}
    for resource in spec.get("resources", []):
        path = directory / resource
        found = render(str(path.resolve().relative_to(ROOT))) if path.is_dir() else {
            _key(doc): doc for doc in yaml.safe_load_all(path.read_text()) if doc}
        assert not set(found) & set(objects), f"{target}: {set(found) & set(objects)} defined twice"
        objects.update(found)
    for patch in spec.get("patches", []):
        assert set(patch) == {"path"}, f"{target}: only strategic-merge patch files are rendered here"
        doc = yaml.safe_load((directory / patch["path"]).read_text())
        assert _key(doc) in objects, f"{target}/{patch['path']} patches {_key(doc)}, which is not in the base"
        objects[_key(doc)] = _merge(objects[_key(doc)], doc)
    return objects


@pytest.fixture(scope="module", params=TARGETS)
def rendered(request) -> tuple[str, dict[tuple[str, str], dict]]:
    return request.param, render(request.param)


def test_there_is_a_gpu_overlay():
    assert "gpu" in OVERLAYS


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed: rendered in Python only")
def test_kustomize_renders_what_this_test_renders(rendered):
    target, objects = rendered
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / target)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert {_key(doc): doc for doc in yaml.safe_load_all(out.stdout) if doc} == objects


# -- the API models --------------------------------------------------------------------------------


def test_every_object_is_a_valid_api_object(rendered):
    target, objects = rendered
    assert {kind for kind, _ in objects} == {"Deployment", "Service", "PodDisruptionBudget"}  # no Secret: the user's
    for (kind, name), obj in objects.items():
        version = obj["apiVersion"].split("/")[-1]
        model = getattr(k8s_models, version.capitalize() + kind)
        model.model_validate(obj)  # raises on an unknown field, a missing required one, a wrong type


def test_the_model_check_catches_a_misspelt_field():
    deployment = render("base")[("Deployment", "pdserve-decode")]
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"httpGet": {"path": "/health", "port": 1}}
    with pytest.raises(ValueError, match="livenesProbe"):
        k8s_models.V1Deployment.model_validate(bad)
    bad = copy.deepcopy(deployment)
    del bad["spec"]["template"]["spec"]["containers"][0]["env"][1]["valueFrom"]["secretKeyRef"]["key"]
    with pytest.raises(ValueError, match="key"):
        k8s_models.V1Deployment.model_validate(bad)


# -- the containers against pdserve's CLI ----------------------------------------------------------


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _expand(word: str, env: dict[str, dict]) -> str:
    """$(VAR) as the kubelet expands it, with a pod IP standing in for status.podIP."""
    def value(m: re.Match) -> str:
        entry = env[m.group(1)]
        if "value" in entry:
            return entry["value"]
        assert entry["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, f"$({m.group(1)}) on a command line"
        return POD_IP
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, word)


def parse(container: dict) -> argparse.Namespace:
    command = container["command"] + container.get("args", [])
    assert command[:1] == ["pdserve"] and command[1] in ("router", "worker"), command
    argv = [_expand(str(word), _env(container)) for word in command[1:]]
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{container['name']}: pdserve refuses its command line {argv}")


def containers(objects: dict) -> list[tuple[dict, dict, argparse.Namespace]]:
    """(Deployment, container, its parsed command line) for every container."""
    return [(obj, c, parse(c)) for obj in objects.values() if obj["kind"] == "Deployment"
            for c in obj["spec"]["template"]["spec"]["containers"]]


def _port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def test_secrets_come_from_the_secret_never_a_command_line(rendered, monkeypatch):
    _, objects = rendered
    for obj, container, args in containers(objects):
        env = _env(container)
        assert env[TOKEN_ENV]["valueFrom"]["secretKeyRef"] == {"name": SECRET_NAME, "key": "token"}
        for name, entry in env.items():
            if name.startswith("PDSERVE_"):
                assert "value" not in entry and "secretKeyRef" in entry["valueFrom"], f"{name} is not from the Secret"
        words = " ".join(container["command"] + container.get("args", []))
        assert not re.search(r"--(token|api-key|admin-key)\b(?!-file)", words)
        assert SECRET_NAME not in container.get("args", [])
        # each one binds 0.0.0.0, which pdserve allows only with the token given
        assert args.host == "0.0.0.0"
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        monkeypatch.delenv(API_KEY_ENV, raising=False)
        with pytest.raises(ValueError, match=TOKEN_ENV):
            router_secrets(args) if args.command == "router" else worker_token(args)
        monkeypatch.setenv(TOKEN_ENV, "from-the-secret")
        token = router_secrets(args)[1] if args.command == "router" else worker_token(args)[0]
        assert token == "from-the-secret"


def test_probes_ask_health_on_the_served_port(rendered):
    _, objects = rendered
    for obj, container, args in containers(objects):
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] == "/health", f"{container['name']}: {probe}"
            assert _port(container, get["port"]) == args.port
        annotations = obj["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == args.port
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), f"{container['name']}: {kind}"


def test_workers_reach_the_router_and_advertise_their_pod(rendered):
    _, objects = rendered
    service, peers = objects[("Service", "pdserve-router")], objects[("Service", "pdserve-router-peers")]
    every_router = f"dns+http://{peers['metadata']['name']}:{peers['spec']['ports'][0]['port']}"
    router = objects[("Deployment", "pdserve-router")]
    assert service["spec"]["selector"] == peers["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"]  # every pod's IP
    roles = {}
    for obj, container, args in containers(objects):
        if args.command != "worker":
            assert _port(container, service["spec"]["ports"][0]["targetPort"]) == args.port
            assert _port(container, peers["spec"]["ports"][0]["targetPort"]) == args.port
            assert args.peers == every_router and args.advertise_host == POD_IP  # the routers find each other
            continue
        roles[args.role] = obj
        assert args.router == every_router  # each worker registers with every router
        assert args.advertise_host == POD_IP  # from the downward API, not the unroutable 0.0.0.0
        assert _port(container, "kv") == args.kv_port != 0  # a fixed KV port, declared
        assert "shm" not in args.transfer.split(",")  # each pod has its own /dev/shm
        liveness = container["livenessProbe"]
        grace = obj["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > args.drain_timeout  # SIGTERM drains, then deregisters, before SIGKILL
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > args.drain_timeout  # an admin drain
    assert set(roles) == {"prefill", "decode"}  # two Deployments: each pool scales on its own


def test_two_routers_never_both_down_by_choice(rendered):
    _, objects = rendered
    router = objects[("Deployment", "pdserve-router")]
    budget = objects[("PodDisruptionBudget", "pdserve-router")]
    assert router["spec"]["replicas"] == 2
    assert router["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    assert budget["spec"]["selector"] == router["spec"]["selector"]
    assert 1 <= budget["spec"]["minAvailable"] < router["spec"]["replicas"]  # one may go, never both
    spread = router["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = spread["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"] == router["spec"]["selector"]  # apart from each other, on nodes that allow it


def test_the_gpu_overlay_puts_each_pool_on_its_own_gpu_nodes():
    objects = render("overlays/gpu")
    pools = {}
    for obj, container, args in containers(objects):
        if args.command != "worker":
            continue
        pod = obj["spec"]["template"]["spec"]
        assert args.device == "cuda"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        pools[args.role] = pod["nodeSelector"]
    assert pools["prefill"] != pools["decode"]
