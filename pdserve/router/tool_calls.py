"""Tool calls in the Hermes format (Qwen's, and most open models' templates): the model writes each
call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` after any text. The router
parses an answer into OpenAI's `tool_calls` (`parse`), holds back streamed text that may be the
start of a call (`CallStream`), and, for `tool_choice` "required" or a named function, asks for a
structured output that is exactly one call whose arguments match the function's JSON schema
(`forced_call`), so they always parse.
"""

from __future__ import annotations

import json
import re
import uuid

from pdserve.structure import JSON_LAYOUT

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(\{.*?\})\s*" + re.escape(CLOSE), re.DOTALL)


def forced_call(tools: list[dict], name: str | None) -> str:
    """A Lark grammar: one call of the tool `name` (or of any of `tools`), its arguments inside
    that tool's parameter schema."""
    chosen = [t for t in tools if name is None or t["name"] == name]
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                               "arguments": t["parameters"] or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = {"x-guidance": JSON_LAYOUT, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
    return f"start: {json.dumps(OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CLOSE)}"


def parse(text: str) -> tuple[str | None, list[dict]]:
    """(the text before the first call, or None if empty; the calls, in OpenAI's shape). A call
    whose JSON does not parse stays text."""
    calls, first = [], None
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        first = match.start() if first is None else first
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


class CallStream:
    """A streamed answer's text, let out as soon as it cannot be part of a call; the rest waits
    for the end, where `finish` parses it."""

    def __init__(self) -> None:
        self.held = ""

    def feed(self, text: str) -> str:
        self.held += text
        at = self.held.find(OPEN)
        if at < 0:  # keep back only what could still grow into the opening tag
            at = next((i for i in range(max(0, len(self.held) - len(OPEN) + 1), len(self.held))
                       if OPEN.startswith(self.held[i:])), len(self.held))
        out, self.held = self.held[:at], self.held[at:]
        return out

    def finish(self) -> tuple[str | None, list[dict]]:
        held, self.held = self.held, ""
        return parse(held)
