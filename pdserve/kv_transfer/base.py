"""What every KV transfer backend shares: the KV layout both sides must agree on, leases,
transfer statuses, and the mapping from token positions to slots of a paged KV cache.

The interface is non-blocking on both sides:
- the prefill side's `KVSender` (api.py; one per decode peer and backend, chosen in registry.py).
- the decode side's leases (leases.py): `open`, `close`, and events (KV landed, peer aborted,
  blocks safe to reuse) delivered to the decode worker's own queue; the receiver (receiver.py)
  feeds them what prefill peers send over a socket.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import asdict, dataclass, field, replace

import torch

from pdserve.errors import LayoutMismatch, ModelMismatch, TransferError
from pdserve.limits import MAX_TENSOR_PARALLEL
from pdserve.models.arch_config import ArchConfig, model_fingerprint


class TransferStatus(enum.IntEnum):
    """Of one request's transfer. Worst first: the status of several parts is their minimum."""

    FAILED = 0  # connection lost or refused
    REJECTED = 1  # the receiver refused it (stale fence, closed lease)
    ABORTED = 2  # ended on purpose by either side
    PENDING = 3  # queued or in flight
    DONE = 4  # all writes and the notify left this side



@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one token's KV (all layers) in a worker's pool, and the model it belongs to.

    A tensor-parallel worker's pool holds each rank's heads as a layer of its own (`ranks` of them
    per model layer: layer i of rank r is layer `i * ranks + r`, with `num_kv_heads` of the model's
    heads, the rank's share). A sender writes in the layout of the worker it writes to
    (`split_across` its ranks), so the receiving side never re-sorts anything."""

    model_hash: str
    num_layers: int  # layers of the pool: the model's (times its ranks), and a draft head's
    num_kv_heads: int  # heads of one pool layer
    head_dim: int
    dtype: str  # torch dtype name of the cache, e.g. "float32"
    ranks: int = field(default=1, compare=False)  # implied by the two above, for a given model

    @classmethod
    def of(cls, cfg: ArchConfig, dtype: torch.dtype, head: str = "", ranks: int = 1) -> KVLayout:
        """A model's KV layout; with a draft head (named `head`), its layer is one more, and the
        layout names both (workers share KV only where their heads agree too)."""
        name = model_fingerprint(cfg)
        if head:
            name = hashlib.sha256(f"{name}:{head}".encode()).hexdigest()
        return cls(name, cfg.num_layers * ranks + bool(head), cfg.num_kv_heads // ranks, cfg.head_dim,
                   str(dtype).split(".")[-1], ranks)

    def split_across(self, ranks: int) -> KVLayout:
        """The same model's KV as a worker of `ranks` tensor-parallel ranks holds it."""
        if ranks == self.ranks:
            return self
        heads = self.num_kv_heads * self.ranks
        if ranks < 1 or heads % ranks or self.num_layers % self.ranks:
            raise LayoutMismatch(f"KV layout mismatch: {heads} KV heads cannot be split across {ranks} ranks")
        return KVLayout(self.model_hash, self.num_layers // self.ranks * ranks, heads // ranks, self.head_dim,
                        self.dtype, ranks)

    def pool_layers(self, layer: int) -> range:
        """The pool layers holding model layer `layer`'s KV (one per rank); past the model's layers
        (a draft head's), the one layer it names."""
        if self.ranks == 1:
            return range(layer, layer + 1)
        return range(layer * self.ranks, (layer + 1) * self.ranks)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token's K and V in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    def check_compatible(self, other: KVLayout) -> None:
        if self.model_hash != other.model_hash:
            raise ModelMismatch(
                f"model mismatch: this worker serves model {self.model_hash[:12]}, the peer {other.model_hash[:12]}"
            )
        if self.dtype != other.dtype:
            raise LayoutMismatch(
                f"KV dtype mismatch: this worker holds KV in {self.dtype}, the peer in {other.dtype}; give every "
                "worker the same --dtype (auto is measured per CPU, and machines of different kinds may differ)"
            )
        if self != other:
            raise LayoutMismatch(f"KV layout mismatch: {asdict(self)} vs {asdict(other)}")


@dataclass(slots=True)
class Lease:
    """Blocks a decode worker reserved for one request's prompt KV, valid for one fence."""

    request_id: str
    fence: int  # unique per lease on the decode worker; writes carrying another are stale
    block_table: list[int]  # decode worker's block ids
    block_size: int  # decode worker's block size
    start: int  # first position to be written (earlier ones hit decode's prefix cache)
    end: int  # number of prompt tokens
    deadline: float  # monotonic time after which decode stops waiting
    timeout_s: float = 0.0  # how far a renewal moves the deadline from now (0: a renewal does not)
    received: list[int] = field(default_factory=list)  # per layer: positions below this landed
    # The draft model's KV, where the decode worker drafts with one (`DraftKV`): the blocks of its
    # draft pool, written from position 0 (that pool caches no prefix), its layers numbered after
    # the target's on the wire. Optional: a lease lands without it, and the draft computes it then.
    draft_block_table: list[int] = field(default_factory=list)
    draft_received: list[int] = field(default_factory=list)  # per draft layer, as `received`

    def slot_runs(self, start: int, end: int, draft: bool = False) -> list[tuple[int, int]]:
        return slot_runs(self.draft_block_table if draft else self.block_table, self.block_size, start, end)

    @property
    def complete(self) -> bool:
        return all(r == self.end for r in self.received)

    @property
    def draft_complete(self) -> bool:
        """Whether the draft model's KV landed whole (there was some to land)."""
        return bool(self.draft_received) and all(r == self.end for r in self.draft_received)


@dataclass(frozen=True, slots=True)
class DraftKV:
    """A draft model's paged KV cache beside the target's (`--speculative draft:PATH`): on the wire
    its layers follow the target's (layer `num_layers + j` of a WRITE is its layer j), always raw.
    `layout.model_hash` names the draft model and its weight format: two workers ship draft KV only
    where theirs agree (a draft is verified, so a mismatch would cost speed, never correctness)."""

    layout: KVLayout
    cache: torch.Tensor  # [layers, slots, 2, kv_heads, head_dim]

    @classmethod
    def of(cls, cfg: ArchConfig, weights: str, cache: torch.Tensor) -> DraftKV:
        """A draft model's KV, by its config and how its weights are held (e.g. "int4")."""
        layout = KVLayout.of(cfg, cache.dtype)
        name = hashlib.sha256(f"{layout.model_hash}:{weights}".encode()).hexdigest()
        return cls(replace(layout, model_hash=name), cache)


def peer_ranks(peer: dict) -> int:
    """The tensor-parallel ranks a decode worker's offer names (1 where it names none)."""
    ranks = peer.get("ranks", 1)
    if type(ranks) is not int or not 1 <= ranks <= MAX_TENSOR_PARALLEL:
        raise TransferError(f"bad offer from the decode worker: ranks {ranks!r}")
    return ranks


def split_layout(layout: KVLayout, peer: dict, draft: DraftKV | None = None) -> KVLayout:
    """This side's layout as the decode worker of `peer` (an offer) holds it: a sender writes the
    peer's pool layers. A draft model's KV has no ranks to split: it goes only to as many ranks."""
    ranks = peer_ranks(peer)
    if draft is not None and ranks != layout.ranks:
        raise TransferError(f"a draft model's KV goes to a worker of as many tensor-parallel ranks "
                            f"({layout.ranks}), not {ranks}")
    return layout.split_across(ranks)


def slot_runs(block_table: list[int], block_size: int, start: int, end: int) -> list[tuple[int, int]]:
    """Positions [start, end) as runs (first slot, count) of consecutive slots in a paged cache.
    A table may come from a peer: a negative block id is refused, not counted from the end."""
    runs: list[tuple[int, int]] = []
    pos = start
    while pos < end:
        block = pos // block_size
        if block >= len(block_table):
            raise TransferError(f"position {pos} is past the {len(block_table)} blocks of the table")
        if block_table[block] < 0:
            raise TransferError(f"block id {block_table[block]} (entry {block} of the table) is negative")
        slot = block_table[block] * block_size + pos % block_size
        n = min(end, (block + 1) * block_size) - pos
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((slot, n))
        pos += n
    return runs


def cut_runs(runs: list[tuple[int, int]], begin: int, end: int) -> list[tuple[int, int]]:
    """Slots [begin, end) of the sequence that the runs (first slot, count) describe."""
    out, offset = [], 0
    for slot, n in runs:
        lo, hi = max(begin, offset), min(end, offset + n)
        if lo < hi:
            out.append((slot + lo - offset, hi - lo))
        offset += n
    return out


def kv_bytes_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache `[layers, slots, 2, kv_heads, head_dim]` as bytes `[layers, slots, slot_bytes]`."""
    layers, slots = kv_cache.shape[:2]
    return kv_cache.view(layers, slots, -1).view(torch.uint8)
