"""`pdserve bench-structured` on the tiny model: both parts run, and the JSON says what they measured."""

from __future__ import annotations

import json

from pdserve.bench.structured import main


def test_it_measures_masks_and_throughput(tiny_llama, tmp_path):
    out = tmp_path / "structured.json"
    assert main(["--model", str(tiny_llama), "--dtype", "float32", "--requests", "2", "--max-tokens", "8",
                 "--rounds", "1", "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    for name in ("json schema", "json object"):
        masks = result["masks"][name]
        assert masks["tokens"] > 5 and 0 < masks["token_us_median"] <= masks["token_us_p90"] and masks["build_us"] > 0
    t = result["throughput"]
    assert t["plain"]["output_tokens"] == t["json schema"]["output_tokens"] == 16  # both run to the length limit
    assert t["json_schema_over_plain"] > 0
