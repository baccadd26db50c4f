"""Tool calls in the formats open models write them, parsed out of an answer's text into OpenAI's
`tool_calls`, streamed as argument deltas, and forced through a grammar when the request says so.

A format (`ToolFormat`) is how a model lays its calls out after any text, each call a JSON object
with the function's "name" and its "arguments" (Llama writes "parameters"):
- `hermes` (Hermes, Qwen, SmolLM and most open templates): `<tool_call>\\n{...}\\n</tool_call>`,
  one block a call;
- `llama3_json` (Llama 3.1 and later): the answer is the calls, `{...}` (after `<|python_tag|>`
  where the model writes one), several separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of the calls.

The router picks the format from the model's chat template (`choose`), or `--tool-call-parser`
names it. `ToolCalls` binds a format to the tokenizer: a marker that is one special token of the
vocabulary (Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`) is matched by its id in a forced
call's grammar, and such requests keep special tokens in their text so that the parser sees it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pdserve.structure import JSON_LAYOUT
from pdserve.tokenizer import Tokenizer

# a call object's head as a model writes it: its name first, then where its arguments begin
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    marker: str  # what opens the calls ("" for llama3_json: its calls open with their first brace)
    first: re.Pattern  # from the marker (or the answer's start) to the first call's brace
    between: re.Pattern  # from the end of one call to the next one's brace
    arguments_key: str  # the key a forced call writes its arguments under
    template_signs: tuple[str, ...]  # text in a chat template that says the model writes this format

    def grammar(self, call: str, marker: str) -> str:
        """A Lark rule body for one call (`call`: a %json item) after `marker` (a grammar item)."""
        if self.name == "hermes":
            return f"{marker} {json.dumps(chr(10))} {call} {json.dumps(chr(10) + '</tool_call>')}"
        if self.name == "mistral":
            return f'{marker} "[" {call} "]"'
        return call


HERMES = ToolFormat("hermes", "<tool_call>", re.compile(r"<tool_call>\s*(?=\{)"),
                    re.compile(r"\s*</tool_call>\s*<tool_call>\s*(?=\{)"), "arguments", ("<tool_call>",))
LLAMA3_JSON = ToolFormat("llama3_json", "", re.compile(r"\s*(?:<\|python_tag\|>)?\s*(?=\{)"),
                         re.compile(r"\s*;\s*(?=\{)"), "parameters", ("<|python_tag|>", "ipython"))
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", re.compile(r"\[TOOL_CALLS\]\s*\[?\s*(?=\{)"),
                     re.compile(r"\s*,\s*(?=\{)"), "arguments", ("[TOOL_CALLS]",))
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
PARSER_CHOICES = ("auto", *FORMATS)


def choose(name: str, chat_template: str | None) -> ToolFormat:
    """The format `name` names, or for "auto" the one the chat template shows (hermes where it shows
    none: the most common)."""
    if name != "auto":
        return FORMATS[name]
    template = chat_template or ""
    for fmt in (MISTRAL, HERMES, LLAMA3_JSON):
        if any(sign in template for sign in fmt.template_signs):
            return fmt
    return HERMES


class ToolCalls:
    """A format bound to the model's tokenizer."""

    def __init__(self, fmt: ToolFormat, tokenizer: Tokenizer | None = None) -> None:
        self.format = fmt
        marker_id = _special_id(tokenizer, fmt.marker)
        # a marker that is a special token: matched by its id, and kept in the answer's text
        self.keeps_special_tokens = marker_id is not None
        self._marker = f"<[{marker_id}]>" if marker_id is not None else json.dumps(fmt.marker) if fmt.marker else ""

    def forced_call(self, tools: list[dict], name: str | None) -> str:
        """A Lark grammar: one call of the tool `name` (or of any of `tools`), its arguments inside
        that tool's parameter schema."""
        key = self.format.arguments_key
        chosen = [t for t in tools if name is None or t["name"] == name]
        calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                   key: t["parameters"] or {"type": "object"}},
                  "required": ["name", key], "additionalProperties": False} for t in chosen]
        schema = {"x-guidance": JSON_LAYOUT, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
        return f"start: {self.format.grammar('%json ' + json.dumps(schema), self._marker)}"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(the text before the calls, or None if empty; the calls, in OpenAI's shape). Text with no
        call that parses is all content."""
        start, objects = _calls_in(self.format, text)
        calls = [c for c in (_openai_call(o) for o in objects) if c is not None]
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def stream(self) -> CallStream:
        return CallStream(self.format, self.parse)


class CallStream:
    """A streamed answer: its text let out as soon as it cannot be part of a call, and its calls as
    OpenAI streams them: a call's id and name once its name is known, then its arguments as the
    model writes them (their pieces join to the call's JSON arguments, as the model wrote them).
    A call whose name does not come first is let out whole at the end (`finish`)."""

    def __init__(self, fmt: ToolFormat, parse) -> None:
        self.format, self._parse = fmt, parse
        self.held = ""  # text from where calls may begin
        self.in_calls = False  # the marker (or the first call's brace) has come
        self.at = 0  # the current call's brace, in `held`
        self.current: str | None = None  # the current call's id, once its name is let out
        self.sent = 0  # characters of the current call's arguments let out
        self.streamed: list[str] = []  # ids of the calls let out
        self.started = False  # text let out (llama3_json: its calls only open an answer)

    @property
    def called(self) -> bool:
        return bool(self.streamed)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(text to let out now, call deltas to let out now)."""
        self.held += text
        out = "" if self.in_calls else self._text_before_calls()
        return out, self._deltas() if self.in_calls else []

    def finish(self) -> tuple[str, list[dict]]:
        """What is left at the end: (text, call deltas)."""
        held, self.held = self.held, ""
        if not self.streamed:  # nothing let out as a call: the whole of it parsed at once
            content, calls = self._parse(held)
            self.streamed = [c["id"] for c in calls]
            return content or "", [{"index": k, **c} for k, c in enumerate(calls)]
        if self.current is not None:  # the last call let out ends where the answer did
            return "", []
        rest = []  # calls after the last one let out whose names did not come first
        for value in _values(self.format, held, self.at):
            call = _openai_call(value)
            if call is not None:
                rest.append({"index": len(self.streamed) + len(rest), **call})
        self.streamed += [c["id"] for c in rest]
        return "", rest

    def _text_before_calls(self) -> str:
        fmt = self.format
        if fmt is LLAMA3_JSON:  # calls only where the answer starts with them
            stripped = self.held.lstrip()
            if not self.started:
                match = fmt.first.match(self.held)
                if match:
                    self.in_calls, self.at = True, match.end()
                    return ""
                if not stripped or "<|python_tag|>".startswith(stripped):
                    return ""  # may still open calls
            self.started = True
            out, self.held = self.held, ""
            return out
        at = self.held.find(fmt.marker)
        if at < 0:  # keep back only what could still grow into the marker
            at = next((i for i in range(max(0, len(self.held) - len(fmt.marker) + 1), len(self.held))
                       if fmt.marker.startswith(self.held[i:])), len(self.held))
            out, self.held = self.held[:at], self.held[at:]
            return out
        out, self.held = self.held[:at], self.held[at:]
        match = fmt.first.match(self.held)
        if match:
            self.in_calls, self.at = True, match.end()
        return out

    def _deltas(self) -> list[dict]:
        deltas = []
        while True:
            head = _HEAD.match(self.held, self.at)
            if head is None:  # not yet, or a call whose name does not come first (`finish`)
                return deltas
            if self.current is None:
                self.current = f"call_{uuid.uuid4().hex[:24]}"
                self.streamed.append(self.current)
                deltas.append({"index": len(self.streamed) - 1, "id": self.current, "type": "function",
                               "function": {"name": _unescape(head.group(1)), "arguments": ""}})
            begin = head.end()
            end = _value_end(self.held, begin)
            piece = self.held[begin + self.sent: len(self.held) if end is None else end]
            if piece:
                deltas.append({"index": len(self.streamed) - 1, "function": {"arguments": piece}})
                self.sent += len(piece)
            close = None if end is None else _value_end(self.held, self.at)  # the call object's end
            following = None if close is None else self.format.between.match(self.held, close)
            if following is None:
                return deltas
            self.at, self.sent, self.current = following.end(), 0, None


def _calls_in(fmt: ToolFormat, text: str) -> tuple[int, list[object]]:
    """(where the calls begin, the JSON values of the calls) in `text`."""
    if fmt is LLAMA3_JSON:
        match = fmt.first.match(text)
    else:
        at = text.find(fmt.marker)
        match = fmt.first.match(text, at) if at >= 0 else None
    if match is None:
        return len(text), []
    return (match.start() if fmt.marker else 0), _values(fmt, text, match.end())


def _values(fmt: ToolFormat, text: str, pos: int) -> list[object]:
    """The JSON values from text[pos] on, one after another as the format separates calls."""
    values = []
    while True:
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return values
        values.append(value)
        following = fmt.between.match(text, end)
        if following is None:
            return values
        pos = following.end()


def _openai_call(value: object) -> dict | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments)}}


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value starting at text[i] ends (one past its last character), or None if the
    text ends first."""
    if i >= len(text):
        return None
    first = text[i]
    if first == '"':
        return _string_end(text, i)
    if first not in "{[":  # a number or a literal: ends where its characters do
        j = i
        while j < len(text) and text[j] not in ",}] \t\r\n":
            j += 1
        return j if j < len(text) else None
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _unescape(name: str) -> str:
    try:
        return json.loads(f'"{name}"')
    except ValueError:
        return name


def _special_id(tokenizer: Tokenizer | None, marker: str) -> int | None:
    """The id of `marker` where it is one special token of the tokenizer's vocabulary."""
    if tokenizer is None or not marker:
        return None
    token_id = tokenizer.backend.token_to_id(marker)
    return token_id if token_id is not None and token_id in tokenizer.all_special_ids else None
