"""The Grafana dashboard: a well-formed model that imports anywhere, asking only for series the
router exports, and committed as the code builds it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import RouterMetrics
from pdserve.router.rollout import Rollout
from tests.telemetry.scrapes import exposition, finish_request, worker_entry

COMMITTED = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve-overview.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


@pytest.fixture(scope="module")
def board() -> dict:
    return json.loads(COMMITTED.read_text())


def queries(board: dict) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its variables' queries."""
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    return exprs + [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]


def exported_series() -> dict[str, set[str]]:
    """Each series a router's /metrics carries -> the labels its samples have, with requests seen,
    workers registered and each labelled counter counted once (a family that still has no child
    counts by its type, its labels unknown)."""
    metrics = RouterMetrics()
    finish_request(metrics, ttft_s=0.05, transfer_s=0.01)
    finish_request(metrics, ttft_s=0.05, outcome="error")
    metrics.rebalances.labels("to_decode").inc()
    metrics.migrations.labels("hot_spot").inc()
    metrics.worker_rejoins.labels("decode").inc()
    metrics.rollouts.labels("rolled_back").inc()
    metrics.track_rollout(Rollout())  # as the router does
    metrics.track_shadow(lambda: None)
    text = exposition(metrics, [worker_entry("p0", "prefill"), worker_entry("d0", "decode", kv_landed=3)])
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ()):
            labels.setdefault(family.name + suffix, set())
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """Each series an expression selects, with the labels its matchers name (the job aside)."""
    return [(name, set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers)) - {"job"})
            for name, matchers in re.findall(r"\b(pdserve_[a-z0-9_]+)(?:\{([^}]*)\})?", expr)]


def test_the_model_is_well_formed(board):
    assert board["uid"] == "pdserve-overview" and board["title"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)
    rows = [panel["title"] for panel in board["panels"] if panel["type"] == "row"]
    assert rows == ["Latency", "SLA", "Pools", "KV", "Changes", "Versions"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    graphs = [panel for panel in board["panels"] if panel["type"] != "row"]
    for panel in graphs:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"]), panel["title"]
    units = {panel["fieldConfig"]["defaults"]["unit"] for panel in graphs}
    assert {"s", "Bps", "percentunit", "reqps"} <= units
    for expr in queries(board):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def test_the_alert_levels_are_drawn(board):
    from pdserve.telemetry.thresholds import ALERT_ABOVE

    drawn = {}
    for panel in board["panels"]:
        steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
        for target in panel.get("targets", []):
            drawn.update({target["expr"].split("{")[0]: step["value"] for step in steps if step["value"]})
    assert drawn == ALERT_ABOVE


def test_every_series_asked_for_is_one_the_router_exports(board):
    exported = exported_series()
    used = {name for expr in queries(board) for name, _ in selectors(expr)}
    assert len(used) >= 25  # the rows ask for what the router has, not a token few
    assert sorted(used - exported.keys()) == []
    for expr in queries(board):  # and by labels its series have: a wrong one would select nothing
        chosen = selectors(expr)
        have = set().union(*(exported[name] for name, _ in chosen))
        for name, matched in chosen:
            assert matched <= exported[name], f"{name} has no label {matched - exported[name]}: {expr}"
        for grouped in re.findall(r"by \(([^)]*)\)", expr):
            assert {g.strip() for g in grouped.split(",")} <= have, expr


def test_the_committed_file_is_what_the_code_builds(tmp_path):
    pytest.importorskip("grafana_foundation_sdk", reason="the dashboards extra is not installed")
    from pdserve.cli import main

    out = tmp_path / "board.json"
    assert main(["dashboard", "--out", str(out)]) == 0
    assert out.read_text() == COMMITTED.read_text(), (
        "deploy/grafana/pdserve-overview.json is stale: pdserve dashboard --out deploy/grafana/pdserve-overview.json")
