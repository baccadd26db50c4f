"""The transfer benchmark on a tiny model: every part runs, KV arrives intact, the JSON has its
shape; never a speed."""

from __future__ import annotations

import json

import pytest
import torch

import pdserve.bench.first_token as first_token
import pdserve.bench.transfer as bench
from pdserve.kv_transfer.leases import EventKind, ReceiverEvent
from pdserve.kv_transfer.timed_link import Link, TransferMismatch
from pdserve.models.arch_config import ArchConfig
from tests.worker.cluster import BACKENDS


def test_links_and_limits_take_turns(tiny_llama):
    cfg = ArchConfig.from_hf_config(json.loads((tiny_llama / "config.json").read_text()))
    num_bytes = 100 * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_layers
    contenders = {"memcpy": bench.Memcpy(num_bytes, shared=True), "loopback": bench.Loopback(num_bytes)}
    for backend in BACKENDS:
        contenders[backend] = Link(cfg, torch.float32, backend, 100)
    contenders["tcp-int8"] = Link(cfg, torch.float32, "tcp", 100, "int8")
    try:
        best = bench.take_turns(contenders, reps=2)
    finally:
        for c in contenders.values():
            c.close()  # a Link checks that the KV arrived unchanged
    assert set(best) == set(contenders)  # each one's time is the machine's; only that it ran is ours


def _tiny_cfg(tiny_llama) -> ArchConfig:
    return ArchConfig.from_hf_config(json.loads((tiny_llama / "config.json").read_text()))


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_kv_that_arrives_changed_is_an_error_not_an_assert(tiny_llama, backend):
    # TransferMismatch, not AssertionError: the check must survive `python -O`
    link = Link(_tiny_cfg(tiny_llama), torch.float32, backend, 40)
    try:
        link.once()
        link.dst[0, 3, 0, 0, 0] += 1.0  # one value of the landed KV
    finally:
        with pytest.raises(TransferMismatch, match=f"{backend}: KV arrived changed"):
            link.close()


def test_a_transfer_that_does_not_land_is_an_error(tiny_llama):
    link = Link(_tiny_cfg(tiny_llama), torch.float32, "tcp", 40)
    try:
        link.events.put(ReceiverEvent(EventKind.FAILED, "bench", 1, reason="injected"))
        with pytest.raises(TransferMismatch, match="tcp: the transfer ended in FAILED, not LANDED"):
            link.once()
    finally:
        link.dst.copy_(link.src)  # only the outcome is under test here, not the bytes
        link.close()


def test_ttft_and_quantized_parts(tiny_llama):
    ttft = first_token.ttft_comparison(str(tiny_llama), "float32", "tcp", prompt_len=40, reps=1, vocab=256)
    cfg = _tiny_cfg(tiny_llama)
    token_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_layers  # K and V, float32, every layer
    assert ttft["kv_bytes_sent"] == (64 + 40) * token_bytes  # the warm-up prompt's KV and the measured one's
    assert len(ttft["colocated_all_s"]) == len(ttft["disaggregated_all_s"]) == 1  # the times are the machine's
    prompts = [[(i * 13 + j) % 250 + 1 for j in range(20 + 9 * i)] for i in range(3)]
    # int8 KV moves the tiny model's logits by about 1e-3: greedy decoding never notices
    agree = first_token.greedy_agreement(str(tiny_llama), "float32", "int8", prompts, new_tokens=4)
    assert agree["prompts"] == 3 and agree["identical"] == 3 and agree["mean_tokens_before_first_difference"] == 4
    err = first_token.logit_error(str(tiny_llama), "float32", "int8", prompts)
    assert err["first_token_flips"] == 0
    assert 0 < err["max_abs_logit_error"] < 0.01  # not 0: the KV did go through int8


@pytest.mark.slow
def test_quick_run_on_the_default_model(tmp_path):
    out = tmp_path / "bench_transfer.json"
    assert bench.main(["--quick", "--backends", "tcp,shm", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {r["backend"] for r in result["transfer"]} == {"tcp", "shm"}
    assert len(result["ttft"]) == 2 and len(result["quantized"]) == 2
