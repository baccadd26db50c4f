"""`pdserve bench-speculative` on the tiny model: every workload at every stream count against the
baseline, the drafts counted, the JSON and the plot written."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.speculative import main


def test_it_measures_each_method_against_no_speculation(tiny_llama, tmp_path):
    out = tmp_path / "spec.json"
    assert main(["--model", str(tiny_llama), "--dtype", "float32", "--streams", "1,2", "--requests", "2",
                 "--max-tokens", "24", "--rounds", "1", "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["methods"] == ["off", "ngram", "suffix"]
    for workload in ("rewrite", "code-fix", "chat"):
        for streams in ("1", "2"):
            cell = result["results"][workload][streams]
            assert cell["off"]["output_tok_s"] > 0 and cell["off"]["drafts"] == 0
            for method in ("ngram", "suffix"):
                assert cell[method]["decode_speedup"] > 0 and cell[method]["output_speedup"] > 0
                assert cell[method]["draft_tokens_accepted"] <= cell[method]["draft_tokens"]
                # float32: speculation gives the tokens decoding one at a time gives
                assert cell[method]["rounds_with_the_baselines_tokens"] == "1 of 1"
    for method in ("ngram", "suffix"):
        assert sum(result["results"][w][s][method]["drafts"] for w in result["results"] for s in ("1", "2")) > 0
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("args", [["--methods", "ngram,off"], ["--streams", "0"], ["--workloads", "poetry"],
                                  ["--streams", "one"]])
def test_bad_arguments_are_refused(args):
    with pytest.raises(SystemExit):
        main(args)
