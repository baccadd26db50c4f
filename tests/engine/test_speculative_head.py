"""Speculative decoding with a draft head (`--speculative head:PATH`, EAGLE or MTP weights): output
equal to decoding one token at a time whatever the head guesses; its drafts what a dense
computation of the head over the model's own hidden states gives (transformers' model for those);
the head's KV in the model's blocks, whole after drafts, aborts and preemption; disaggregated,
the prefill worker's head KV and feature land with the model's and the decode worker drafts at
once; and files that are no head of the model refused at load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve import SamplingParams
from pdserve.layers.rotary import apply_rotary
from pdserve.engine.spec.head import feature_from_wire
from pdserve.models.arch_config import ArchConfig
from pdserve.models.draft_head import load_draft_head, save_random_draft_head
from pdserve.models.loader import load_checkpoint
from tests.factories import assert_engine_idle, make_llm, make_speculating_llm
from tests.worker.cluster import CASES_WITH_MEMORY, prompt

PROMPTS = [prompt(23, seed=1), prompt(40, seed=2), prompt(7, seed=3) * 4]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return make_llm(tiny_llama)


@pytest.fixture(scope="module")
def heads(tiny_llama, tmp_path_factory):
    cfg = ArchConfig.from_hf_config(load_checkpoint(tiny_llama).hf_config)
    root = tmp_path_factory.mktemp("heads")
    return {style: save_random_draft_head(root / style, cfg, style, scale=0.2) for style in ("eagle", "mtp")}


def heading_llm(model, head, **engine_args):
    return make_speculating_llm(model, speculative=f"head:{head}", **engine_args)


@pytest.mark.parametrize("style", ["eagle", "mtp"])
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_greedy_output_equals_decoding_one_token_at_a_time(tiny_llama, plain, heads, style, num_tokens):
    """The head guesses (random weights: mostly wrong) and every guess is verified: the tokens are
    plain decoding's, and its KV, in the model's blocks, is all given back."""
    llm = heading_llm(tiny_llama, heads[style], num_speculative_tokens=num_tokens)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    assert got == want
    assert llm.engine.scheduler.num_drafted > 0
    # a bias both the model and the head read: every draft is kept, the longest drafts verified
    biased = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={5: 50.0})
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], biased)]
    before = llm.engine.scheduler.num_accepted
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], biased)]
    assert got == want and llm.engine.scheduler.num_accepted - before >= 3 * 8
    assert_engine_idle(llm)


def test_seeded_sampling_is_the_same_with_the_head(tiny_llama, plain, heads):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)]
    llm = heading_llm(tiny_llama, heads["eagle"], num_speculative_tokens=3)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)]
    assert got == want
    assert_engine_idle(llm)


def _dense_head(head, embed, rotary, features, next_ids):
    """The EAGLE head over a whole sequence at once, written out: fc, causal attention with rotary
    positions (grouped K/V heads), MLP, the residuals."""
    cfg = head.layer.self_attn
    x = F.linear(torch.cat([embed[next_ids], features], dim=-1), head.fc, head.fc_bias)
    t = x.shape[0]
    qkv = F.linear(x, head.layer.self_attn.qkv_proj)
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    cos_sin = rotary(torch.arange(t))
    q = apply_rotary(q.view(t, cfg.num_heads, cfg.head_dim), cos_sin)
    k = apply_rotary(k.view(t, cfg.num_kv_heads, cfg.head_dim), cos_sin)
    group = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.view(t, cfg.num_kv_heads, cfg.head_dim).repeat_interleave(group, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    x = x + F.linear(o.transpose(0, 1).reshape(t, -1), head.layer.self_attn.o_proj)
    h = head.layer.post_attention_layernorm(x)
    gate, up = F.linear(h, head.layer.mlp.gate_up_proj).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, head.layer.mlp.down_proj)


def test_the_drafts_are_the_heads_own_over_the_models_hidden_states(tiny_llama, heads, hf_models):
    """Each draft the engine proposed, against the head computed densely over the whole sequence
    so far: the model's features from transformers' model, the head chained on its own features.
    The same tokens: the features handed over each step, the head's KV at every position and the
    drafting steps' positions are right."""
    hf = hf_models["llama"]
    llm = heading_llm(tiny_llama, heads["eagle"], num_speculative_tokens=3)
    proposer = llm.engine.scheduler.proposer
    seen: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose_all

    def recorded(wanted):
        drafts = propose(wanted)
        seen.extend((req.token_ids(0, req.num_tokens), d) for (req, _), d in zip(wanted, drafts) if d)
        return drafts
    proposer.propose_all = recorded
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert len(seen) >= 6
    head, model = llm.engine.runner.head, llm.engine.runner.model
    for tokens, drafts in seen[:: max(1, len(seen) // 8)]:
        with torch.no_grad():
            features = hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
            want = []
            next_ids = list(tokens[1:])
            for _ in drafts:
                out = _dense_head(head, model.embed_tokens, model.rotary, features, torch.tensor(next_ids))
                want.append(int(F.linear(out[-1], hf.lm_head.weight).argmax()))
                features = torch.cat([features, out[-1:]])
                next_ids.append(want[-1])
        assert drafts == want, (tokens, drafts, want)


def test_the_heads_kv_is_given_back_after_aborts_and_preemption(tiny_llama, plain, heads):
    """A pool too small for every request at once: requests are preempted (their head KV goes
    with their blocks, and is computed again with them) and one is aborted mid-draft; the rest's
    tokens are plain decoding's and every block comes back."""
    llm = heading_llm(tiny_llama, heads["mtp"], num_speculative_tokens=4, kv_cache_memory=40 * 2048, max_num_batched_tokens=64,
                      max_num_seqs=4)
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, sp) for p in PROMPTS + [prompt(50, seed=9)]]
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 6:
            engine.abort(ids[1])
    assert engine.scheduler.num_preemptions > 0
    want = plain.generate([{"prompt_token_ids": p} for p in (PROMPTS[0], PROMPTS[2], prompt(50, seed=9))], sp)
    assert [done[ids[i]] for i in (0, 2, 3)] == [o.outputs[0].token_ids for o in want]
    assert_engine_idle(llm)


@pytest.mark.parametrize("backend", CASES_WITH_MEMORY)
def test_a_disaggregated_decode_worker_drafts_from_the_prefill_workers_head(tiny_llama, plain, heads, backend):
    """1P1D, both workers with the head: the prefill worker's head KV rides the lease as one more
    layer and its feature comes with the first token, so the decode worker drafts at its first
    step, computing no prompt position; the tokens are the colocated ones and both workers end
    idle. A prefill worker without the head is refused the lease (another KV layout): the decode
    worker computes the prompt, and still drafts."""
    from tests.worker.cluster import Cluster

    tokens = PROMPTS[1]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = plain.generate([{"prompt_token_ids": tokens}], sp)[0].outputs[0].token_ids
    with_head = {"speculative": f"head:{heads['eagle']}", "num_speculative_tokens": 3}
    with Cluster(tiny_llama, backend, prefill=with_head, decode=with_head) as c:
        engine = c.d.worker.engine
        engine.scheduler.observe_step = lambda rows, seconds: None  # every draft verified
        first_steps = []
        propose = engine.scheduler.proposer.propose_all
        engine.scheduler.proposer.propose_all = lambda wanted: first_steps.append(
            [r.num_computed_tokens for r, _ in wanted if r.head_feature is not None]) or propose(wanted)
        got, _ = c.generate(tokens, max_tokens=24)
        assert got == want
        stats = c.d.worker.stats()
        assert stats.kv_landed == 1 and stats.kv_recomputed == 0 and stats.draft_tokens > 0
        assert first_steps[0] == [len(tokens)]  # drafting from the first decode step, on the prefill worker's feature
        c.wait_idle()
    if backend != "tcp":
        return
    with Cluster(tiny_llama, backend, decode=with_head) as c:
        c.d.worker.engine.scheduler.observe_step = lambda rows, seconds: None
        got, _ = c.generate(tokens, max_tokens=24)
        assert got == want
        stats = c.d.worker.stats()
        assert stats.kv_recomputed == 1 and stats.draft_tokens > 0
        c.wait_idle()


def test_files_that_are_no_head_of_the_model_are_refused(tiny_llama, heads, tmp_path):
    cfg = ArchConfig.from_hf_config(load_checkpoint(tiny_llama).hf_config)
    load = lambda path: load_draft_head(path, cfg, torch.float32, torch.device("cpu"))  # noqa: E731
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickled"):
        load(tmp_path / "pickled")
    with pytest.raises(ValueError, match="no draft head"):
        load(tiny_llama)  # a model, not a head
    wider = save_random_draft_head(tmp_path / "wider", ArchConfig(**{**vars_of(cfg), "hidden_size": 2 * cfg.hidden_size}))
    with pytest.raises(ValueError, match="hidden_size"):
        load(wider)
    with pytest.raises(ValueError, match="head:PATH"):
        make_llm(tiny_llama, speculative="head:")


def vars_of(cfg: ArchConfig) -> dict:
    from dataclasses import asdict

    return asdict(cfg)


def test_a_feature_from_a_prefill_worker_is_checked(tiny_llama, heads):
    """What a prefill worker sends as the head's feature is read only if it is one: the model's
    hidden size in float32 values, all finite (else the lease fails and the prompt is computed
    here); nothing where this worker has no head."""
    llm = heading_llm(tiny_llama, heads["eagle"])
    size, runner = llm.engine.model_config.hidden_size, llm.engine.runner
    feature = feature_from_wire(torch.arange(size, dtype=torch.float32).numpy().tobytes(), size, runner)
    assert torch.equal(feature, torch.arange(size, dtype=torch.float32))
    with pytest.raises(ValueError, match="float32 values"):
        feature_from_wire(bytes(4 * size - 4), size, runner)
    with pytest.raises(ValueError, match="not finite"):
        feature_from_wire(torch.full((size,), float("nan")).numpy().tobytes(), size, runner)
    assert feature_from_wire(b"", size, runner) is None
    with pytest.raises(ValueError, match="float32 values"):  # checked as it lands, before anything changes
        llm.engine.kv_landed("nobody", 1, head_feature=b"xx")
    assert make_llm(tiny_llama).engine.kv_landed("nobody", 1, head_feature=b"xx") is False  # no head: not read
