"""`pdserve bench prefix` end to end on the tiny model: with affinity alone the burst stays on the
prefix's holder; with copies the router copies the prefix and the other worker serves part of it."""

from __future__ import annotations

import json

from pdserve.bench.hot_prefix import main


def test_bench_prefix_reports_the_burst_piled_up_and_spread(tiny_llama, tmp_path, capsys):
    assert main(["--model", str(tiny_llama), "--settings", "affinity,copies", "--workers", "2", "--requests", "24",
                 "--prefix-tokens", "160", "--own-tokens", "8", "--max-tokens", "24", "--rate", "4",
                 "--copy-rate", "0.2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_prefix.json").read_text())["results"]
    affinity, copies = results["affinity"], results["copies"]
    assert affinity["completed"] == copies["completed"] == 24
    assert sorted(affinity["served_share"].values()) == [0.0, 1.0] and not affinity["copies"].get("copied")
    assert copies["copies"]["copied"] >= 1 and min(copies["served_share"].values()) > 0
    assert copies["transferred_prompt_tokens"] >= 160 // 16 * 16  # the copy: the prefix's full blocks
    out = capsys.readouterr().out
    assert "| affinity | 24/24 |" in out and "| copies | 24/24 |" in out
