"""`pdserve bench-kv` end to end on the tiny model: each case, each setting, its figures and plot;
the returning conversation's tokens came back from the tier where there is one, and only there."""

from __future__ import annotations

import json

from pdserve.bench.kv import main
from tests.engine.test_kv_store import HAVE_STORE


def test_bench_kv_reports_each_case_against_the_feature_off(tiny_llama, tmp_path):
    out = tmp_path / "kv.json"
    assert main(["--model", str(tiny_llama), "--dtype", "float32", "--rounds", "1", "--prompt-len", "64",
                 "--kv-cache-memory", "96KiB", "--host-kv-memory", "1MiB", "--disk-host-memory", "16KiB",
                 "--result-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"returning", "urgent", "journal"}
    assert report["runs"]["journal"]["journal"][0]["journal_writes"] > 0
    assert set(report["results"]["returning"]) == {"no tier", "host raw", "host int8", "disk"} | (
        {"store"} if HAVE_STORE else set())
    assert report["results"]["urgent"]["no pausing"]["speedup"] == 1.0
    runs = report["runs"]["returning"]
    assert runs["no tier"][0]["sources"].get("host", 0) == 0
    assert runs["disk"][0]["sources"]["disk"] > 0
    if HAVE_STORE:
        assert runs["store"][0]["sources"]["store"] > 0
    for tiered in ("host raw", "host int8", "disk"):
        assert runs[tiered][0]["sources"].get("host", 0) + runs[tiered][0]["sources"].get("disk", 0) > 0
        assert runs[tiered][0]["sources"]["computed"] < runs["no tier"][0]["sources"]["computed"]
    assert out.with_suffix(".png").exists()
