"""OpenAI request and response shapes (the subset pdserve serves), and its error shape."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, model_validator

from pdserve.limits import (
    MAX_ABS_LOGIT_BIAS, MAX_ABS_PENALTY, MAX_CHOICE_CHARS, MAX_CHOICES, MAX_CLIENT_N, MAX_CLIENT_PRIORITY,
    MAX_CLIENT_STOP_STRINGS, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_MESSAGES, MAX_REPETITION_PENALTY,
    MAX_SCHEMA_DEPTH, MAX_SEQUENCE_TOKENS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS, MAX_STRUCTURE_CHARS,
    MAX_PROMPTS, MAX_TOKENS_LIMIT, MAX_TOOLS, MAX_TOP_K, SEED_LIMIT, TOKEN_ID_LIMIT,
)
from pdserve.router.tool_calls import HERMES, ToolCalls
from pdserve.wire import Sampling, StructureSpec


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: valid JSON ("\ud800"), but no tokenizer can take it
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS), AfterValidator(_encodable)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Penalty = Annotated[float, Field(allow_inf_nan=False, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)]
TokenIdField = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]  # a JSON object's key "50256" reads as 50256


# Fields of OpenAI's (and vLLM's) API that pdserve does not serve yet, with the values that ask for
# nothing: any other value is refused with a 400 naming the field. Fields clients send that change
# nothing here (`user`, `metadata`, `store`, `service_tier`, `parallel_tool_calls`, ...) are ignored.
NOT_SERVED: dict[str, tuple] = {
    "suffix": (None, ""), "best_of": (None, 1), "functions": (None, []), "function_call": (None, "none", "auto"),
}
COMPLETIONS_REFUSE: dict[str, tuple] = {"tools": (None, []), "tool_choice": (None, "none", "auto")}


def _bounded_json(value: object) -> str:
    """A JSON schema as text, within the structure bounds (size and nesting)."""
    def depth(v: object) -> int:
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        return 1 + max((depth(c) for c in children), default=0) if isinstance(v, (dict, list)) else 0
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > MAX_STRUCTURE_CHARS:
        raise ValueError(f"a JSON schema is at most {MAX_STRUCTURE_CHARS} characters")
    try:
        parsed = json.loads(text) if isinstance(value, str) else value
    except ValueError:
        raise ValueError("the JSON schema is not JSON") from None
    if not isinstance(parsed, (dict, bool)):
        raise ValueError("a JSON schema is an object")
    if depth(parsed) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"a JSON schema nests at most {MAX_SCHEMA_DEPTH} objects and arrays")
    return text


SchemaText = Annotated[dict | str, AfterValidator(_bounded_json)]
StructureText = Annotated[str, Field(min_length=1, max_length=MAX_STRUCTURE_CHARS)]
Choices = Annotated[list[Annotated[str, Field(max_length=MAX_CHOICE_CHARS)]], Field(min_length=1, max_length=MAX_CHOICES)]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(default="schema", max_length=64)
    schema_: SchemaText | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always matches: as if true


class ResponseFormat(BaseModel):
    """OpenAI's: text, any JSON object, or JSON matching a schema."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (one of them)."""
    model_config = ConfigDict(extra="forbid")
    json_: SchemaText | None = Field(default=None, alias="json")
    regex: StructureText | None = None
    choice: Choices | None = None
    grammar: StructureText | None = None
    json_object: bool | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields other clients send that change nothing here
    model: str = Field(max_length=256)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Finite = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Finite = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=-1, ge=-1, le=MAX_TOP_K)
    min_p: Finite = Field(default=0.0, ge=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=MAX_CLIENT_N)
    seed: StrictInt | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_CLIENT_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: StrictInt = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: Finite = Field(default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY)  # vLLM's
    logit_bias: Annotated[dict[TokenIdField, Annotated[Finite, Field(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    stop_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0, lt=TOKEN_ID_LIMIT)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None  # vLLM's
    priority: StrictInt = Field(default=0, ge=0, le=MAX_CLIENT_PRIORITY)
    speculate: bool = True  # pdserve's: false keeps the request's tokens from being drafted
    # structured outputs: OpenAI's `response_format`, or vLLM's `structured_outputs` (and its older
    # `guided_*` fields); at most one of them
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: SchemaText | None = None
    guided_regex: StructureText | None = None
    guided_choice: Choices | None = None
    guided_grammar: StructureText | None = None
    # Not served yet: read so that a request asking for them is refused with a 400 that names the
    # field (`NOT_SERVED`), not answered as if it had not asked.
    functions: Any = None  # OpenAI's older names for tools
    function_call: Any = None

    @model_validator(mode="after")
    def _one_structure(self) -> _Sampling:
        self.structure()
        return self

    def _forced_tool_call(self, calls: ToolCalls) -> list[tuple[str, str]]:
        return []

    def structure_field(self) -> str:
        """The field that asked for the structure."""
        return next(name for name in ("tool_choice", "response_format", "structured_outputs", "guided_json",
                                      "guided_regex", "guided_choice", "guided_grammar")
                    if getattr(self, name) is not None and (name != "response_format"
                                                            or self.response_format.type != "text"))

    def structure(self, calls: ToolCalls = ToolCalls(HERMES)) -> StructureSpec | None:
        """The structure the output must match, from whichever field asks for one (a forced tool
        call in the format of `calls`)."""
        asked: list[tuple[str, str]] = self._forced_tool_call(calls)
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("json", '{"type": "object"}'))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            asked.append(("json", rf.json_schema.schema_))
        so = self.structured_outputs
        for kind, value in ([("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar),
                             ("json", '{"type": "object"}' if so.json_object else None)] if so else []) + [
                ("json", self.guided_json), ("regex", self.guided_regex), ("choice", self.guided_choice),
                ("grammar", self.guided_grammar)]:
            if value is not None:
                asked.append((kind, json.dumps(value) if kind == "choice" else value))
        if len(asked) > 1:
            raise ValueError("ask for one structured output: response_format, structured_outputs, one guided_* "
                             "field, or a tool_choice that forces a call")
        return StructureSpec(kind=asked[0][0], spec=asked[0][1]) if asked else None

    def sampling(self, max_tokens: int, calls: ToolCalls = ToolCalls(HERMES)) -> Sampling:
        """What the workers sample by; stop strings stay here (`stop_strings`): the router makes the
        text. A forced tool call is written in the format of `calls`."""
        return Sampling(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        min_p=self.min_p, seed=self.seed, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                        min_tokens=self.min_tokens, stop_token_ids=list(self.stop_token_ids or []),
                        presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                        repetition_penalty=self.repetition_penalty, logit_bias=dict(self.logit_bias or {}),
                        logprobs=self.logprobs_asked(), prompt_logprobs=self.prompt_logprobs_asked(),
                        structure=self.structure(calls), speculate=self.speculate)

    def logprobs_asked(self) -> int | None:
        """How many most likely tokens to report with each token's log-probability; None: none."""
        raise NotImplementedError

    def prompt_logprobs_asked(self) -> int | None:
        """The same for the prompt's tokens (completions with `echo`); None: none."""
        return None

    def echoed(self) -> bool:
        """The answer begins with the prompt (completions' `echo`)."""
        return False

    def token_ids_named(self) -> dict[str, list[int]]:
        """The token ids the request names outside its prompt, by field (each must be in the vocabulary)."""
        return {"logit_bias": list(self.logit_bias or {}), "stop_token_ids": list(self.stop_token_ids or [])}

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


TokenIdPrompt = Annotated[list[Annotated[StrictInt, Field(ge=0, lt=TOKEN_ID_LIMIT)]],
                          Field(min_length=1, max_length=MAX_SEQUENCE_TOKENS)]


class CompletionRequest(_Sampling):
    # one prompt (text or token ids), or several: each answered as a request of its own, its
    # choices numbered after the previous prompt's (prompt i's j-th is choice i * n + j)
    prompt: (Text | TokenIdPrompt | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenIdPrompt], Field(min_length=1, max_length=MAX_PROMPTS)])
    # each token's log-probability and this many most likely tokens' (OpenAI's completions shape)
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | Literal[False] | None = None
    echo: bool = False  # the answer begins with the prompt (with its tokens' log-probabilities, if asked)
    suffix: Any = None  # not served yet, as best_of: see NOT_SERVED
    best_of: Any = None
    tools: Any = None  # tools are chat's: refused here (COMPLETIONS_REFUSE)
    tool_choice: Any = None

    def logprobs_asked(self) -> int | None:
        return None if self.logprobs is None or self.logprobs is False else self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request."""
        p = self.prompt
        return list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]

    def prompt_logprobs_asked(self) -> int | None:
        return self.logprobs_asked() if self.echo else None

    def echoed(self) -> bool:
        return self.echo


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: FunctionName
    description: Annotated[Text, Field(max_length=8192)] | None = None
    parameters: SchemaText | None = None  # a JSON schema, as text once checked
    strict: bool | None = None  # the arguments always match: as if true


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef

    def for_template(self) -> dict:
        f = self.function
        return {"type": "function", "function": {"name": f.name, "description": f.description or "",
                                                 "parameters": json.loads(f.parameters or '{"type": "object"}')}}


class ChosenFunction(BaseModel):
    name: FunctionName


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: ChosenFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: FunctionName
    arguments: Annotated[Text, Field(max_length=MAX_STRUCTURE_CHARS)] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: Annotated[str, Field(max_length=128)] = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's
    tool_call_id: Annotated[str, Field(max_length=128)] | None = None  # a tool's answer to that call

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text ones are served here
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates take it (a call's arguments as an object, as in transformers)."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False  # each token's log-probability, and `top_logprobs` most likely tokens' (0-20)
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ChatCompletionRequest:
        names = {t.function.name for t in self.tools or []}
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice required needs tools")
        return self

    @property
    def calls_tools(self) -> bool:
        """The answer may hold tool calls, to be parsed out of its text."""
        return bool(self.tools) and self.tool_choice != "none"

    def _forced_tool_call(self, calls: ToolCalls) -> list[tuple[str, str]]:
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return []
        name = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        tools = [{"name": t.function.name, "parameters": json.loads(t.function.parameters)
                  if t.function.parameters else None} for t in self.tools]
        return [("grammar", calls.forced_call(tools, name))]

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())
