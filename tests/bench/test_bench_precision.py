"""`pdserve bench-precision`'s pair: a prefill model's KV copied into a decode model's pool scores
and generates as one engine does, when both are the same model (its log-likelihood equals the
engine's own prompt log-probabilities; its greedy tokens, the engine's); and the command runs end
to end on the tiny model, its reference pair agreeing with itself."""

from __future__ import annotations

import json

import torch

from pdserve import SamplingParams
from pdserve.bench.parallel import main as parallel_main
from pdserve.bench.precision import PairRun, main, pairs_of
from tests.factories import make_llm


def test_a_pair_of_one_model_scores_and_generates_as_the_engine(tiny_llama):
    p, d = make_llm(tiny_llama, enable_prefix_caching=False), make_llm(tiny_llama, enable_prefix_caching=False)
    context, continuation = list(range(3, 40)), list(range(100, 120))
    run = PairRun(p, d)
    nats = run.log_likelihood(context, continuation)
    out = make_llm(tiny_llama).generate([{"prompt_token_ids": context + continuation}],
                                        SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    entries = out.prompt_logprobs[len(context):]
    assert [e.token_id for e in entries] == continuation
    expected = sum(e.logprob for e in entries)
    assert abs(nats - expected) < 1e-3
    greedy = make_llm(tiny_llama).generate([{"prompt_token_ids": context}],
                                           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert run.greedy(context, 10) == greedy.outputs[0].token_ids


def test_pairs_put_the_reference_first():
    assert pairs_of("bf16/int4, int4/int4,bf16/bf16") == [("bf16", "bf16"), ("bf16", "int4"), ("int4", "int4")]


def test_the_commands_run_end_to_end(tiny_llama, tmp_path, capsys):
    out = tmp_path / "precision.json"
    assert main(["--model", str(tiny_llama), "--pairs", "f32/int8", "--samples", "2", "--context-len", "16",
                 "--continuation-len", "8", "--tokens", "4", "--rounds", "1", "--prompt-len", "32",
                 "--result-json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["bf16/bf16"]["greedy_agreement"] == 1.0 and "f32/int8" in results
    assert out.with_suffix(".png").exists()
    par = tmp_path / "parallel.json"
    assert parallel_main(["--model", str(tiny_llama), "--settings", "tp1,tp2", "--rounds", "1", "--prompt-len", "32",
                          "--decode-tokens", "4", "--batch", "2", "--dtype", "float32",
                          "--result-json", str(par)]) == 0
    measured = json.loads(par.read_text())
    assert set(measured["results"]) == {"tp1", "tp2"} and measured["allreduce_s"]["2"]
    assert torch.tensor(list(measured["results"]["tp2"]["measured"].values())).gt(0).all()
