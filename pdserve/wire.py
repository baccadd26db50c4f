"""Every message that crosses a process boundary between the router, the workers and the benchmark.

Each is a msgspec struct, encoded as JSON; tensors travel apart from these, as raw bytes in the KV
transfer's frames (kv_transfer/codec.py). Every field is bounded here, so a reader decodes a body
with `decode(raw, Type)` and either has a well-formed message or a `BadMessage` naming the field:
the HTTP edges answer it with a 400 before any handler sees the message.

    router ──GenerateRequest──────────────► decode worker (or colocated: `both`)
    router ◄─OutputLine (NDJSON, one a step)─ decode worker
    router ──AbortRequest─────────────────► worker
    decode ──PrefillLease─────────────────► prefill worker ──► PrefillAccepted
    decode ──AbortRequest (with its fence)─► prefill worker
    worker ──Registration─────────────────► router ──► Registered
    worker ──Heartbeat(WorkerStats)───────► router (every third of the lease)
    worker ──Deregistration───────────────► router (a drained worker leaving)

Text never crosses: workers stream token ids, and the router alone turns them into text and
applies stop strings (router/responses.py).
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, Literal, TypeVar, get_args

import msgspec
from msgspec import Meta, Struct

from pdserve.limits import (
    MAX_ABS_LOGIT_BIAS, MAX_ABS_PENALTY, MAX_BLOCK_SIZE, MAX_FENCE, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_N,
    MAX_REPETITION_PENALTY, MAX_SEQUENCE_TOKENS, MAX_STRUCTURE_CHARS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MAX_TOKENS_LIMIT, MAX_TOP_K,
    MAX_TENSOR_PARALLEL, MAX_WIRE_PRIORITY, SEED_LIMIT, TOKEN_ID_LIMIT,
)
from pdserve.sampling_params import SamplingParams, Structure
# Ids that peers send; '#' and '@' stay free for the ids the engine derives from them.
# Every pattern ends in \Z, not $: `$` also matches before a trailing newline, which would pass.
REQUEST_ID = r"^[A-Za-z0-9_.:\-]{1,200}\Z"

RequestId = Annotated[str, Meta(pattern=REQUEST_ID)]
TokenId = Annotated[int, Meta(ge=0, lt=TOKEN_ID_LIMIT)]
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_SEQUENCE_TOKENS)]
Prompt = Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_SEQUENCE_TOKENS)]
Url = Annotated[str, Meta(pattern=r"^https?://[^\s/?#]{1,255}(/[^\s]{0,255})?\Z")]
Fence = Annotated[int, Meta(ge=0, le=MAX_FENCE)]
Count = Annotated[int, Meta(ge=0, le=1 << 62)]
# where a request's KV came from (`pdserve_prompt_tokens_by_source_total`): computed on the worker,
# its prefix cache, its host or disk tier, a shared store, another worker's lease, or what a
# restarted worker found of its own
TokenSource = Literal["computed", "prefix_cache", "host", "disk", "store", "transferred", "resumed"]
Size = Annotated[int, Meta(ge=0, le=1 << 40)]  # requests, sequences, blocks: far below this in any pool
Seconds = Annotated[float, Meta(ge=0, le=1e9)]
ModelHash = Annotated[str, Meta(max_length=128)]
Role = Literal["prefill", "decode", "both"]
NODE_NAME = r"^[A-Za-z0-9_.:@\-]{0,128}\Z"  # a host name, a Ray node id
VERSION_LABEL = r"^[A-Za-z0-9_.\-]{0,64}\Z"  # a build or model a worker serves ("": unlabelled)


def version_label(text: str) -> str:
    """A `--version-label` / `--stable-version` flag's value, checked."""
    if not re.fullmatch(VERSION_LABEL, text):
        raise ValueError(f"expected up to 64 letters, digits and _.-, got {text!r}")
    return text


SHM_DIR = "/dev/shm"  # where shared KV pools live
SHM_POOL_NAME = r"^pdserve-kv-\d+-[0-9a-f]{16}\Z"  # a shared KV pool file under /dev/shm: its owner's pid, 64 random bits
NodeName = Annotated[str, Meta(max_length=128, pattern=NODE_NAME)]
# a W3C trace context (version 00), or "" where the request is not traced
TraceParent = Annotated[str, Meta(max_length=55, pattern=r"^(00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2})?\Z")]
KVTransferDtype = Literal["auto", "int8", "fp8"]  # how KV crosses: as computed, or quantized
KV_TRANSFER_DTYPES: tuple[str, ...] = get_args(KVTransferDtype)
BlockSize = Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)]


class Message(Struct, forbid_unknown_fields=True):
    """A message between pdserve's processes: unknown fields are refused, not ignored."""


class BadMessage(ValueError):
    """A body that is not the message it should be; `field` names where it went wrong."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.field = field


M = TypeVar("M", bound=Struct)
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_NAMED = re.compile(r"field `([^`]*)`")  # "Object missing required field `x`", "... unknown field `x`"


@functools.cache
def _decoder(kind: type[M]) -> msgspec.json.Decoder:
    """One decoder per message kind: `msgspec.json.decode(raw, type=kind)` reads the kind's
    annotations again on every call (tens of microseconds, for each line of every stream)."""
    return msgspec.json.Decoder(kind)


def decode(raw: bytes | str, kind: type[M]) -> M:
    """`raw` as a `kind`, or BadMessage naming the field (`prompt_token_ids.3`) and what is wrong."""
    try:
        return _decoder(kind).decode(raw)
    except msgspec.ValidationError as e:
        text = str(e)
        found = _PATH.search(text)
        where = found.group(1) if found else ""
        message = text[: found.start()] if found else text
        if named := _NAMED.search(message):
            where = f"{where}.{named.group(1)}" if where else named.group(1)
        field = where.replace("[", ".").replace("]", "") or None  # as the OpenAI edge names them: a.1.b
        raise BadMessage(f"{field}: {message}" if field else message, field) from None
    except msgspec.DecodeError as e:
        raise BadMessage(f"the body is not valid JSON: {e}", None) from None


def encode(message: Struct) -> bytes:
    return msgspec.json.encode(message)


# -- router -> worker: a request ---------------------------------------------------------------


class StructureSpec(Message):
    """A structured output (`sampling_params.Structure`): the kind, and its spec as text."""

    kind: Literal["json", "regex", "choice", "grammar"]
    spec: Annotated[str, Meta(min_length=1, max_length=MAX_STRUCTURE_CHARS)]


class Sampling(Message):
    """How a worker samples a request: the engine's `SamplingParams` without the text-side ones
    (stop strings, special tokens in the text), which the router applies."""

    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=MAX_TOP_K)] = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Meta(ge=0, le=SEED_LIMIT - 1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)] | None = 16
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS_LIMIT)] = 0
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    presence_penalty: Annotated[float, Meta(ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=MAX_REPETITION_PENALTY)] = 1.0
    logit_bias: Annotated[dict[TokenId, Annotated[float, Meta(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]],
                          Meta(max_length=MAX_LOGIT_BIAS_ENTRIES)] = {}
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    structure: StructureSpec | None = None
    speculate: bool = True

    def params(self) -> SamplingParams:
        """The engine's sampling parameters (ValueError for a combination no field bound catches,
        such as min_tokens past max_tokens). Workers do not detokenize: `detokenize=False`."""
        return SamplingParams(**_copied(self, self.__struct_fields__), detokenize=False)

    def first_token_params(self, resumed: int) -> SamplingParams:
        """A prefill worker's parameters: the same sampler (seed and all), for the one token after
        the prompt and `resumed` tokens so far, with nothing that could stop it sooner."""
        return self.params().clone(n=1, max_tokens=resumed + 1, min_tokens=0, stop_token_ids=[])


def _copied(source: object, fields: tuple[str, ...]) -> dict:
    def copy(v: object) -> object:
        if isinstance(v, StructureSpec):
            return Structure(v.kind, v.spec)
        return list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
    return {f: copy(getattr(source, f)) for f in fields}


class GenerateRequest(Message, kw_only=True):
    """POST /v1/generate. `output_token_ids` resumes a request begun elsewhere (a migration)."""

    request_id: RequestId | None = None
    prompt_token_ids: Prompt
    output_token_ids: TokenIds = []
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    priority: Annotated[int, Meta(ge=-MAX_WIRE_PRIORITY, le=MAX_WIRE_PRIORITY)] = 0
    prefill_url: Url | None = None
    resume_of: RequestId | None = None  # its id on this worker before a restart: resume from the KV kept
    stream: bool = True
    traceparent: TraceParent = ""  # the router's span: the worker's spans are its children


class AbortRequest(Message, omit_defaults=True):
    """POST /v1/abort: a request, or (`index`) one completion of n that the router found its stop
    string in; POST /v1/prefill/abort: a lease, with its fence."""

    request_id: RequestId
    fence: Fence | None = None
    index: Annotated[int, Meta(ge=0, lt=MAX_N)] | None = None


class Aborted(Message):
    request_id: str
    aborted: bool = True


# -- worker -> router: the output stream --------------------------------------------------------


LogProb = Annotated[float, Meta(ge=-1e30, le=0.0)]  # finite: JSON has no infinity


class TokenLogprob(Message, array_like=True):
    """A generated token's log-probability, and the most likely tokens' ([id, log-probability])."""

    token_id: TokenId
    logprob: LogProb
    top: Annotated[list[tuple[TokenId, LogProb]], Meta(max_length=MAX_LOGPROBS)] = []


class CompletionDelta(Message):
    index: Annotated[int, Meta(ge=0, lt=MAX_N)]
    token_ids: TokenIds
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    # one per token of `token_ids`, where the request asked for log-probabilities
    logprobs: Annotated[list[TokenLogprob], Meta(max_length=MAX_SEQUENCE_TOKENS)] | None = None


class ErrorInfo(Message):
    """OpenAI's error shape, as every HTTP error of pdserve's."""

    message: Annotated[str, Meta(max_length=4096)]
    type: Annotated[str, Meta(max_length=64)] = "server_error"
    param: Annotated[str, Meta(max_length=256)] | None = None
    code: int = 500


class ErrorReply(Message):
    """The body of any 4xx/5xx answer of a worker or the router."""

    error: ErrorInfo


class OutputLine(Message):
    """One NDJSON line of a /v1/generate response: the tokens new since the previous line. An
    ErrorReply line ends the stream instead; an empty line is a keep-alive."""

    request_id: str = ""
    outputs: Annotated[list[CompletionDelta], Meta(max_length=MAX_N)] = []
    finished: bool = False
    num_prompt_tokens: Count = 0
    num_cached_tokens: Count = 0
    phase_times: Annotated[dict[Annotated[str, Meta(max_length=32)], float], Meta(max_length=16)] | None = None
    # with Sampling.prompt_logprobs, in the first line with a token: one per prompt token (the first null)
    prompt_logprobs: Annotated[list[TokenLogprob | None], Meta(max_length=MAX_SEQUENCE_TOKENS)] | None = None


def error_line(message: str, code: int = 500, kind: str = "server_error") -> bytes:
    """The line that ends a stream on an error (an ErrorReply)."""
    return encode(ErrorReply(error=ErrorInfo(message=message, type=kind, code=code))) + b"\n"


def decode_line(raw: bytes | str) -> OutputLine | ErrorReply:
    """One non-empty line of a /v1/generate stream; BadMessage if it is neither kind."""
    try:
        return decode(raw, OutputLine)
    except BadMessage as not_output:
        try:
            return decode(raw, ErrorReply)
        except BadMessage:
            raise not_output from None


# -- decode worker -> prefill worker: a lease of blocks ------------------------------------------

Port = Annotated[int, Meta(ge=1, le=65535)]
Host = Annotated[str, Meta(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_.:\-\[\]]+\Z")]
Slots = Annotated[int, Meta(ge=1, le=1 << 40)]


# A decode worker's tensor-parallel ranks: a sender writes its pool's split of the heads
KVRanks = Annotated[int, Meta(ge=1, le=MAX_TENSOR_PARALLEL)]


class TcpOffer(Message):
    """Where a decode worker's KV port listens."""

    host: Host
    port: Port
    ranks: KVRanks = 1


class ShmOffer(Message):
    host: Host
    port: Port
    path: Annotated[str, Meta(max_length=255)]
    num_slots: Slots
    ranks: KVRanks = 1


class NixlOffer(Message):
    host: Host
    port: Port
    agent_metadata: Annotated[str, Meta(max_length=1 << 20)]  # NIXL's own metadata, base64
    base_addr: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
    num_slots: Slots
    mem: Literal["DRAM", "VRAM"] = "DRAM"
    device_id: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    ranks: KVRanks = 1


class MemoryOffer(Message):
    """The in-process test backend's (kv_transfer/memory.py): refused from another process."""

    host: Host
    port: Port
    pid: Annotated[int, Meta(ge=1, le=1 << 31)]
    endpoint: Annotated[str, Meta(pattern=r"^[0-9a-f]{1,64}\Z")]
    ranks: KVRanks = 1


class DecodeOffers(Message, omit_defaults=True):
    """How a prefill worker may reach the decode worker that leased it blocks, per backend."""

    tcp: TcpOffer | None = None
    shm: ShmOffer | None = None
    nixl: NixlOffer | None = None
    memory: MemoryOffer | None = None

    def as_dicts(self) -> dict[str, dict]:
        """backend -> its offer as a plain dict, for the transfer backends."""
        return {name: msgspec.structs.asdict(offer) for name in self.__struct_fields__
                if (offer := getattr(self, name)) is not None}


class PrefillLease(Message, kw_only=True):
    """POST /v1/prefill: compute this prompt and write its KV from position `start` into these
    blocks of the decode worker, fenced by `fence`."""

    request_id: RequestId
    fence: Fence
    prompt_token_ids: Prompt
    output_token_ids: TokenIds = []  # a resumed request's tokens so far
    sampling: Sampling
    start: Annotated[int, Meta(ge=0, le=MAX_SEQUENCE_TOKENS)]
    block_table: Annotated[list[Annotated[int, Meta(ge=0, lt=TOKEN_ID_LIMIT)]], Meta(max_length=MAX_SEQUENCE_TOKENS)]
    block_size: BlockSize
    model_hash: ModelHash
    kv_transfer_dtype: KVTransferDtype = "auto"
    decode: DecodeOffers
    # where the decode worker drafts with a draft model: the blocks its draft's KV of positions
    # [0, end) goes to, and which draft (a prefill worker with another, or none, ships none)
    draft_block_table: Annotated[list[Annotated[int, Meta(ge=0, lt=TOKEN_ID_LIMIT)]],
                                 Meta(max_length=MAX_SEQUENCE_TOKENS)] = []
    draft_hash: ModelHash = ""
    traceparent: TraceParent = ""  # the decode worker's span: the prefill worker's spans are its children


class PrefillAccepted(Message):
    request_id: str
    fence: Fence
    backend: str


class KVInfo(Message):
    """GET /v1/kv_info: a decode worker's KV layout and how to reach it."""

    layout: dict[str, str | int]
    backends: DecodeOffers


# -- worker -> router: membership --------------------------------------------------------------


class Registration(Message):
    """POST /internal/register."""

    url: Annotated[str, Meta(max_length=512, pattern=r"^https?://[^\s/?#]{1,255}/?\Z")]
    role: Role
    model_hash: ModelHash
    block_size: BlockSize = 16  # of its KV cache: the router hashes prompt prefixes in blocks this size
    node: NodeName = ""  # the machine it runs on, as its operator knows it (host name, Ray node)
    # the version it serves: requests and their KV stay among workers of one version (rollouts)
    version: Annotated[str, Meta(max_length=64, pattern=VERSION_LABEL)] = ""


class Registered(Message):
    worker_id: str
    lease_s: Seconds
    heartbeat_s: Seconds


class WorkerStats(Message):
    """A worker's load and counters: GET /stats, /metrics, and every heartbeat. The router routes by
    the load fields; the counters are summed in its /metrics or shown as sent."""

    role: Role = "both"
    model_hash: ModelHash = ""
    running: Size = 0
    waiting: Size = 0
    waiting_for_kv: Size = 0
    queued_prefill_tokens: Count = 0
    kv_blocks_total: Annotated[int, Meta(ge=1, le=1 << 40)] = 1
    kv_blocks_used: Size = 0
    kv_blocks_free: Size = 0
    capacity: Size = 0  # sequences it holds at most, running and queued (0: not said)
    step_token_budget: Size = 0  # tokens one step computes at most: its prefill queue drains this fast a step
    step_latency_ewma_ms: Annotated[float, Meta(ge=0, le=1e9)] = 0.0
    num_steps: Count = 0
    num_preemptions: Count = 0
    prefill_pauses: Count = 0  # steps a running prompt sat out for a more urgent one
    speculative: Annotated[str, Meta(max_length=32)] = "off"  # the method that proposes drafts
    drafts: Count = 0  # speculative decoding: drafts verified (one a request a step)
    draft_tokens: Count = 0  # their tokens
    draft_tokens_accepted: Count = 0  # of those, kept
    draft_prompt_tokens: Count = 0  # prompt tokens a draft model computed on this worker
    # the tokens whose KV requests started from here, by where it came from
    tokens_by_source: dict[TokenSource, Count] = {}
    uptime_s: Seconds = 0.0
    requests_aborted: Count = 0
    requests_failed: Count = 0
    engine_alive: bool = True
    engine_failures: Count = 0
    stale: bool = False  # the engine was busy: the last snapshot, not a fresh one
    draining: bool = False  # finishing what it holds, taking nothing new: route elsewhere
    # decode side
    kv_leases_open: Size = 0
    kv_landed: Count = 0
    kv_recomputed: Count = 0
    kv_stale_writes: Count = 0
    kv_bytes_received: Count = 0
    kv_refused_connections: Count = 0
    kv_forced_disconnects: Count = 0
    kv_lease_renewals: Count = 0  # leases a prefill worker kept waiting while their prompt was paused
    # a durable pool (`--durable-kv`): the same id after a restart, so the router resumes streams there
    durable_kv: Annotated[str, Meta(max_length=64, pattern=r"^[0-9a-f]*\Z")] = ""
    kv_pool_generation: Count = 0  # the pool's attaches: 1 + the restarts that found it
    kv_resumed_requests: Count = 0  # requests resumed from the KV they had before a restart
    kv_resume_rejected: Count = 0  # journaled requests whose KV failed its checks (computed again)
    kv_resume_recomputed_prompt_tokens: Count = 0  # prompt tokens a resumed request computed again
    kv_resumable: Size = 0  # requests whose kept KV waits for them to come back
    # a shared store tier (`--kv-store`): workers saying the same id read each other's blocks
    kv_store: Annotated[str, Meta(max_length=32, pattern=r"^[0-9a-f]*\Z")] = ""
    kv_store_blocks_written: Count = 0
    kv_store_blocks_read: Count = 0
    kv_store_blocks_corrupt: Count = 0  # read back and failed their checks (computed again)
    kv_store_blocks_dropped: Count = 0  # not sent: too much waited to be sent already
    kv_store_errors: Count = 0
    # prefill side
    kv_shipments: Size = 0
    kv_notified: Count = 0
    kv_bytes_sent: Count = 0
    kv_peers: Size = 0

    def as_dict(self) -> dict[str, object]:
        return msgspec.structs.asdict(self)


class Heartbeat(Message):
    """POST /internal/heartbeat: renews the lease; 404 means register again."""

    worker_id: Annotated[str, Meta(max_length=64)]
    stats: WorkerStats


class RoleChange(Message):
    """POST /admin/workers/{id}/role on the router, and POST /v1/role on the worker it forwards to."""

    role: Role


class SlowSteps(Message):
    """POST /v1/faults/slow-steps (fault injection): each engine step takes this much longer."""

    delay_ms: Annotated[float, Meta(ge=0, le=10_000)]


class Deregistration(Message):
    """POST /internal/deregister: a drained worker leaves now, not when its lease runs out."""

    worker_id: Annotated[str, Meta(max_length=64)]
