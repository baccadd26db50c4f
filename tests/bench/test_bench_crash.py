"""`pdserve bench-crash` end to end on the tiny model, the durable setting: the killed decode
worker's streams all complete, resumed from its kept KV, and the report says so."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.crash import main
from pdserve.kv_transfer.shm import shm_available


@pytest.mark.skipif(not shm_available(), reason="needs a writable /dev/shm")
def test_bench_crash_reports_the_resumed_streams(tiny_llama, tmp_path, capsys):
    assert main(["--model", str(tiny_llama), "--dtype", "float32", "--settings", "durable", "--rounds", "1",
                 "--streams", "2", "--prompt-tokens", "32", "--max-tokens", "900", "--kill-after", "20",
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_crash.json").read_text())
    durable = report["results"]["durable"]
    assert durable["completed"] == durable["streams"] == 2 and durable["resumed"] == 2
    assert "| durable | 2 / 2 |" in capsys.readouterr().out
