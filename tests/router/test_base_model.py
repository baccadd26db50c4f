"""A base model (its tokenizer has no chat template) behind a real router and worker on 127.0.0.1,
through the official openai client: a chat completion is a 400 that says why and where to go
instead, before anything is admitted; a completion works as it does offline."""

from __future__ import annotations

import openai
import pytest

from tests.factories import make_base_model, make_llm, offline_text
from tests.router_server import MODEL, RouterServer
from tests.wait import wait_for
from tests.worker.cluster import WorkerServer


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return make_base_model(tmp_path_factory.mktemp("models") / "base")


@pytest.fixture(scope="module")
def served(base_model):
    with WorkerServer(base_model, "both", ["tcp"]) as w, RouterServer(base_model) as rs:
        rs.join(w)
        yield {"client": openai.OpenAI(base_url=rs.url + "/v1", api_key="unused", max_retries=0), "worker": w,
               "router": rs.router}


@pytest.mark.parametrize("extra", [{}, {"stream": True}, {"tools": [{"type": "function", "function": {
    "name": "f", "parameters": {"type": "object", "properties": {}}}}]}], ids=["plain", "stream", "tools"])
def test_chat_is_refused_saying_why(served, extra):
    steps = served["worker"].worker.stats().num_steps
    with pytest.raises(openai.BadRequestError) as e:
        served["client"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, **extra)
    assert e.value.status_code == 400
    assert e.value.type == "invalid_request_error" and e.value.param == "messages"
    assert e.value.body["message"] == (f"the model {MODEL!r} has no chat template, so it cannot take chat messages; "
                                       "send the text as a prompt to /v1/completions instead")
    assert served["router"].admission.requests == 0  # refused before admission: the worker never saw it
    assert served["worker"].worker.stats().num_steps == steps


def test_completions_work(served, base_model):
    client = served["client"]
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0)
    assert r.choices[0].text == offline_text(make_llm(base_model), "hello world", 6)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="hello world", max_tokens=6, temperature=0, stream=True))
    assert streamed == r.choices[0].text
    wait_for(served["worker"].is_idle, 10, "an idle worker")
