"""`pdserve bench upgrade` end to end on the tiny model (slow: `-m slow`): a 1P2D cluster under a
steady load gets a second version's workers, shadows a share of its requests to them, rolls them
out as a canary and promotes them; no client request fails or is lost, the shadow's greedy
answers agree with the primary's (the same model), and the old version ends idle."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.upgrade import main

pytestmark = pytest.mark.slow


def test_an_upgrade_under_load_fails_no_request(tiny_llama, tmp_path):
    out = tmp_path / "upgrade.json"
    code = main(["--model", str(tiny_llama), "--engine-args", "--dtype float32 --kv-cache-memory 8MiB",
                 "--concurrency", "3", "--input-len", "300", "--output-len", "8", "--baseline-s", "3",
                 "--shadow-s", "5", "--shadow-share", "0.5", "--steps", "0.2,1.0", "--step-s", "2",
                 "--min-requests", "3", "--tail-s", "3", "--result-json", str(out), "--server-log-dir", str(tmp_path)])
    report = json.loads(out.read_text())
    assert code == 0, report
    assert report["promoted"] and report["outcomes"]["error"] == report["outcomes"]["lost"] == 0
    assert report["outcomes"]["ok"] > 0 and report["old_version_idle"]
    assert [e["event"] for e in report["rollout_events"]] == ["started", "advanced", "promoted"]
    shadow = report["shadow_load"]
    assert shadow["copies_per_s"] > 0 and shadow["greedy_agreement_mean"] == 1.0
