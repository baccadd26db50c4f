"""deploy/prometheus: the alert rules, checked against what the router exports.

1. Every alert has a severity and a summary, description and runbook line, and a unit test in
   pdserve-alerts_test.yml that sees it fire.
2. Every series an alert reads is one a live router's /metrics has (after a worker registered,
   heartbeat and a request finished): a renamed metric cannot leave an alert silent.
3. Where Debian's `prometheus` package is installed: `promtool check rules` and `promtool test
   rules` pass (the slow end-to-end test runs a real Prometheus: tests/test_alerts_e2e.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pdserve.router.metrics import RequestClock, RouterMetrics
from pdserve.router.registry import Registry
from pdserve.wire import WorkerStats

yaml = pytest.importorskip("yaml")

RULES_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RULES = RULES_DIR / "pdserve-alerts.yml"
RULE_TESTS = RULES_DIR / "pdserve-alerts_test.yml"
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def exported_series() -> set[str]:
    """The series names a router's scrape has once a worker heartbeat and a request finished."""
    metrics = RouterMetrics()
    registry = Registry("m" * 64)
    entry = registry.register("http://127.0.0.1:9", "decode", "m" * 64)
    registry.heartbeat(entry.worker_id, WorkerStats(role="decode", model_hash="m" * 64, kv_landed=3))
    clock = RequestClock(metrics, prompt_tokens=4, remote=True)
    clock.output_line(1, None)
    clock.output_line(1, {"queue_s": 0.1, "prefill_s": 0.2, "transfer_s": 0.05, "decode_s": 0.1})
    clock.finish("ok")
    metrics.worker_rejoins.labels("decode").inc()
    metrics.workers_dropped.inc()
    metrics.rollouts.labels("rolled_back").inc()

    class Admission:
        requests = tokens = 0

    text = metrics.render(Admission(), registry.workers()).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_alert_says_how_bad_and_what_to_do():
    rules = alerts()
    assert len({rule["alert"] for rule in rules}) == len(rules) >= 10
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        for key in ("summary", "description", "runbook"):
            assert rule["annotations"].get(key, "").strip(), f"{rule['alert']} has no {key}"


def test_every_alert_reads_series_the_router_exports():
    exported = exported_series()
    for rule in alerts():
        names = set(re.findall(r"\b(pdserve_[a-z_]+)", rule["expr"]))
        assert names or "up{" in rule["expr"], rule["alert"]
        for name in names:
            assert name in exported, f"{rule['alert']} reads {name}, which the router does not export"


def test_every_alert_has_a_unit_test_that_sees_it_fire():
    tested = yaml.safe_load(RULE_TESTS.read_text())
    fired = {case["alertname"] for test in tested["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert fired == {rule["alert"] for rule in alerts()}
    assert tested["rule_files"] == [RULES.name]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian's prometheus package has it)")
    return path


@pytest.mark.parametrize("args", [["check", "rules", RULES.name], ["test", "rules", RULE_TESTS.name],
                                  ["check", "config", "prometheus.yml"]], ids=" ".join)
def test_promtool_passes(args):
    done = subprocess.run([promtool(), *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
