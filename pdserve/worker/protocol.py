"""The bodies of the worker's control endpoint, every field bounded at the edge.

Only token holders reach these routes (the router, and decode workers leasing KV to prefill
workers), but a bad value must still end in a 400 that names it, never in a failed batch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from pdserve.sampling_params import SamplingParams

MAX_SEQUENCE_TOKENS = 1 << 20  # prompt (or generated) token ids in one request; the model's length is lower
MAX_PRIORITY = 1000  # priorities from peers are in [-MAX_PRIORITY, MAX_PRIORITY]
MAX_BLOCK_SIZE = 1024
MAX_FENCE = (1 << 63) - 1
# Ids that peers send; '#' and '@' stay free for the ids the engine derives from them.
REQUEST_ID = r"^[A-Za-z0-9_.:\-]{1,200}$"

RequestId = Annotated[str, Field(pattern=REQUEST_ID)]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0, lt=1 << 31)]], Field(max_length=MAX_SEQUENCE_TOKENS)]
Url = Annotated[str, Field(pattern=r"^https?://[^\s/?#]{1,255}(/[^\s]{0,255})?$")]


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: RequestId | None = None
    prompt_token_ids: Annotated[TokenIds, Field(min_length=1)]
    output_token_ids: TokenIds = Field(default_factory=list)  # resume: generated elsewhere so far
    sampling: Annotated[dict[str, Any], Field(max_length=32)] = Field(default_factory=dict)
    priority: StrictInt = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    prefill_url: Url | None = None
    stream: bool = True


Port = Annotated[StrictInt, Field(ge=1, le=65535)]
Host = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_.:\-\[\]]+$")]
Slots = Annotated[StrictInt, Field(ge=1, le=1 << 40)]


class TcpOffer(BaseModel):
    """Where a decode worker's KV port listens."""
    model_config = ConfigDict(extra="forbid")
    host: Host
    port: Port


class ShmOffer(TcpOffer):
    path: str = Field(max_length=255)
    num_slots: Slots


class NixlOffer(TcpOffer):
    agent_metadata: str = Field(max_length=1 << 20)  # NIXL's own metadata, base64
    base_addr: StrictInt = Field(ge=0, lt=1 << 64)
    num_slots: Slots
    mem: Literal["DRAM", "VRAM"] = "DRAM"
    device_id: StrictInt = Field(default=0, ge=0, le=1 << 16)


class DecodeOffers(BaseModel):
    """How a prefill worker may reach the decode worker that leased it blocks, per backend."""
    model_config = ConfigDict(extra="forbid")
    tcp: TcpOffer | None = None
    shm: ShmOffer | None = None
    nixl: NixlOffer | None = None


class PrefillBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: RequestId
    fence: StrictInt = Field(ge=0, le=MAX_FENCE)
    prompt_token_ids: Annotated[TokenIds, Field(min_length=1)]
    output_token_ids: TokenIds = Field(default_factory=list)
    sampling: Annotated[dict[str, Any], Field(max_length=32)]
    start: StrictInt = Field(ge=0, le=MAX_SEQUENCE_TOKENS)
    block_table: Annotated[list[Annotated[StrictInt, Field(ge=0, lt=1 << 31)]], Field(max_length=MAX_SEQUENCE_TOKENS)]
    block_size: StrictInt = Field(ge=1, le=MAX_BLOCK_SIZE)
    model_hash: str = Field(max_length=128)
    kv_transfer_dtype: Literal["auto", "int8", "fp8"] = "auto"
    decode: DecodeOffers


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: RequestId
    fence: StrictInt | None = Field(default=None, ge=0, le=MAX_FENCE)


def sampling_params(raw: dict[str, Any]) -> SamplingParams:
    """The sampling settings of a request, or ValueError naming what is wrong."""
    try:
        return SamplingParams(**raw)
    except TypeError as e:  # an unknown field
        raise ValueError(f"bad sampling parameters: {e}") from None
