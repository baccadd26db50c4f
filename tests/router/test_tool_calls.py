"""Tool calls parsed out of answers in each format, streamed as OpenAI streams them (the pieces of
any split join to what parsing the whole answer gives), and the format chosen from a template."""

from __future__ import annotations

import json

import pytest

from pdserve.sampling_params import Structure
from pdserve.router.tool_calls import FORMATS, HERMES, LLAMA3_JSON, MISTRAL, ToolCalls, choose
from pdserve.structure import Grammars
from pdserve.tokenizer import Tokenizer

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"note": "a } in ; text, \" ]"}]}}
CLOCK = {"name": "get_time", "arguments": {}}


def written(fmt, calls: list[dict], before: str = "") -> str:
    """An answer with `calls` as a model writing `fmt` lays them out."""
    if fmt is HERMES:
        return before + "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls)
    if fmt is MISTRAL:
        return before + "[TOOL_CALLS]" + json.dumps(calls)
    return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)


def streamed(tools: ToolCalls, pieces: list[str]) -> tuple[str, list[dict], list[str]]:
    """(text, calls as the client assembles them from the deltas, the ids in order of first sight)."""
    stream = tools.stream()
    text, deltas = "", []
    for piece in pieces:
        out, more = stream.feed(piece)
        text, deltas = text + out, deltas + more
    out, more = stream.finish()
    text, deltas = text + out, deltas + more
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:  # a call's first delta: its id, type and name
            assert d["index"] not in calls and d["type"] == "function"
            calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
        calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return text, [calls[i] for i in sorted(calls)], [calls[i]["id"] for i in sorted(calls)]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_calls_parse_out_of_an_answer_in_each_format(fmt):
    tools = ToolCalls(fmt)
    before = "" if fmt is LLAMA3_JSON else "Let me look. "
    content, calls = tools.parse(written(fmt, [WEATHER, CLOCK], before))
    assert content == (before.strip() or None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (WEATHER["name"], WEATHER["arguments"]), (CLOCK["name"], {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 1000])
def test_streamed_calls_join_to_the_parsed_ones_however_the_text_is_split(fmt, size):
    tools = ToolCalls(fmt)
    before = "" if fmt is LLAMA3_JSON else "Let me look. "
    answer = written(fmt, [WEATHER, CLOCK], before)
    text, calls, _ = streamed(tools, [answer[i:i + size] for i in range(0, len(answer), size)])
    assert text.strip() == before.strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (WEATHER["name"], WEATHER["arguments"]), (CLOCK["name"], {})]


def test_arguments_stream_as_the_model_writes_them():
    """A call's id and name come as soon as its name is whole, then its arguments in pieces, before
    the answer ends."""
    stream = ToolCalls(HERMES).stream()
    assert stream.feed("Sure. <tool_call>\n{\"name\": \"get_wea") == ("Sure. ", [])
    out, deltas = stream.feed("ther\", \"arguments\": {\"city\": \"Pa")
    assert out == "" and deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1] == {"index": 0, "function": {"arguments": '{"city": "Pa'}}
    assert stream.feed('ris"}}\n</tool_call>') == ("", [{"index": 0, "function": {"arguments": 'ris"}'}}])
    assert stream.finish() == ("", []) and stream.called


def test_text_that_only_looks_like_a_call_is_let_out():
    plain = ToolCalls(HERMES).stream()
    assert plain.feed("a < b and <tool") == ("a < b and ", [])
    assert plain.feed(" is not a tag") == ("<tool is not a tag", [])
    assert plain.finish() == ("", []) and not plain.called
    broken = ToolCalls(HERMES)
    assert broken.parse("no call here <tool_call> {broken") == ("no call here <tool_call> {broken", [])
    text, calls, _ = streamed(broken, ["no call here <tool_call> {bro", "ken"])
    assert text == "no call here <tool_call> {broken" and calls == []
    prose = ToolCalls(LLAMA3_JSON)
    assert streamed(prose, ["Hello", ' {"name": "x"}'])[:2] == ('Hello {"name": "x"}', [])


def test_a_call_whose_name_comes_last_is_let_out_whole_at_the_end():
    answer = '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>'
    text, calls, _ = streamed(ToolCalls(HERMES), [answer[:20], answer[20:]])
    assert text == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize(("template", "name"), [
    ("{% for m in messages %}...<tool_call>...{% endfor %}", "hermes"),
    ("{{ '[TOOL_CALLS]' + tool_calls|tojson }}", "mistral"),
    ("Environment: ipython ... <|python_tag|>", "llama3_json"),
    ("{{ messages }}", "hermes"),  # nothing shown: the most common
    (None, "hermes"),
])
def test_the_format_comes_from_the_template_unless_named(template, name):
    assert choose("auto", template).name == name
    for named in FORMATS:
        assert choose(named, template).name == named


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_a_forced_call_grammar_builds_and_accepts_its_own_format(tiny_llama, fmt):
    tokenizer = Tokenizer.from_dir(tiny_llama)
    tools = ToolCalls(fmt, tokenizer)
    grammar = tools.forced_call([{"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"]}}], None)
    grammars = Grammars(tokenizer, tokenizer.vocab_size, (tokenizer.eos_token_id,))
    matcher = grammars.matcher(Structure("grammar", grammar))
    call = {"name": "get_time", ("parameters" if fmt is LLAMA3_JSON else "arguments"): {"zone": "UTC"}}
    text = {"hermes": f"<tool_call>\n{json.dumps(call)}\n</tool_call>", "mistral": f"[TOOL_CALLS][{json.dumps(call)}]",
            "llama3_json": json.dumps(call)}[fmt.name]
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.consume_token(token), text
    assert matcher.is_accepting()
    assert tools.parse(text)[1][0]["function"]["name"] == "get_time"


def test_kept_special_tokens_stay_in_the_text_but_the_one_that_stopped_it_does_not(tiny_llama):
    """Requests whose tool-call marker is a special token keep special tokens in their text; the
    end of sequence that finished the answer is still not text (vLLM's rule)."""
    from pdserve.router.responses import Detokenizers
    from pdserve.wire import CompletionDelta

    tokenizer = Tokenizer.from_dir(tiny_llama)
    eos = tokenizer.eos_token_id
    assert eos in tokenizer.all_special_ids
    word = tokenizer.encode("hello", add_special_tokens=False)
    for skip in (True, False):
        detok = Detokenizers(tokenizer, [1, 2], [], skip_special_tokens=skip)
        text, reason, _ = detok.delta(CompletionDelta(index=0, token_ids=[*word, eos, *word, eos], finish_reason="stop"))
        eos_text = "" if skip else tokenizer.decode([eos])
        assert reason == "stop" and text == "hello" + eos_text + "hello"
        assert detok.num_tokens == 2 * len(word) + 2  # the stopping token still counts as generated
