"""Paged KV blocks: allocation, reference counts, and the prefix cache.

Every block is either referenced by at least one request or sits in the free queue. A freed block
keeps its content hash, so a later request with the same prefix can take it back (a prefix-cache
hit) until allocation evicts it, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict

from typing import TYPE_CHECKING

from pdserve.engine.request import Request
from pdserve.prefix_hash import hash_block

if TYPE_CHECKING:  # the simulator runs the block manager without torch
    from pdserve.engine.kv_tier import HostKVTier


class NoFreeBlocksError(RuntimeError):
    pass


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of a request already registered
        self.tier: HostKVTier | None = None  # where evicted prefix blocks go (`--host-kv-memory`)

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding a prefix of this request's tokens (at least one token is left
        to compute, since the model must produce logits for the next token)."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []  # a prompt whose log-probabilities are asked for is computed, every position
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def find_prefix(self, request: Request) -> tuple[list[int], list[int], dict[str, int]]:
        """The request's prefix blocks in the pool, the host tier's slots of those after them, and
        how many of those the tier read back from below it, by tier (disk, store)."""
        cached = self.find_cached_prefix(request)
        slots = self.find_in_tier(request, len(cached))
        return cached, slots, dict(self.tier.found_below) if slots else {}

    def find_in_tier(self, request: Request, start: int) -> list[int]:
        """The host tier's slots holding the request's prefix blocks from block `start` on (after
        `find_cached_prefix`, which hashed them), with one token still left to compute."""
        if self.tier is None or not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.tier.find(request.block_hashes[start:max_blocks])

    def prefetch(self, request: Request) -> None:
        """A request enters the queue: the tier reads ahead the prefix blocks after the pool's."""
        if (self.tier is None or self.tier.prefetcher is None or not self.enable_prefix_caching
                or request.params.prompt_logprobs is not None):
            return  # nothing below host memory to read from
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hashes = request.block_hashes[:max_blocks]
        i = 0
        while i < len(hashes) and hashes[i] in self._cached:
            i += 1
        self.tier.prefetch(hashes[i:])

    def promote(self, request: Request, start: int, slots: list[int]) -> None:
        """The request was given blocks for its prefix blocks from `start` on that the tier holds
        (`allocate`): their KV comes from those slots before the next step."""
        if slots:
            self.tier.promote(slots, self._tables[request.request_id][start : start + len(slots)])

    # -- changes -------------------------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens; on first allocation, adopt `cached_blocks`.

        Returns False, changing nothing, when the free queue cannot cover it.
        """
        table = self._tables.get(request.request_id)
        if table is None:
            table = []
        elif not cached_blocks and request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return True  # its last block has room (every decode step but one in `block_size`)
        num_total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_total) - len(table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks + revived > len(self._free):
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            table.append(block_id)
        if num_new_blocks > 0:
            table += self._take_free_blocks(num_new_blocks)
        self._tables[request.request_id] = table
        if cached_blocks:
            self._num_hashed[request.request_id] = len(cached_blocks)
        return True

    def cache_full_blocks(self, request: Request, computed: bool = True) -> None:
        """Register the blocks that the request's computed tokens have filled (`computed`: here; a
        tier that shares blocks with other workers gets those at once)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_hashed.get(request.request_id, 0)
        if num_full <= start:
            return
        self._extend_hashes(request, num_full)
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            block_hash = request.block_hashes[i]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id
                if computed and self.tier is not None:
                    self.tier.computed(block_hash, block.block_id)
        self._num_hashed[request.request_id] = num_full

    def free(self, request: Request) -> None:
        self.release(request.request_id)

    def hand_over(self, request_id: str, holder_id: str) -> None:
        """Move a request's blocks to another holder (e.g. a lease awaiting its peer's
        acknowledgement), so that freeing the request leaves them referenced."""
        if holder_id in self._tables:
            raise ValueError(f"block holder {holder_id!r} already exists")
        table = self._tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        if table is not None:
            self._tables[holder_id] = table

    def hold(self, holder_id: str, table: list[int]) -> None:
        """Hold `table`'s blocks for a new holder (KV found in the pool at start: `durable_kv.py`)."""
        if holder_id in self._tables:
            raise ValueError(f"block holder {holder_id!r} already exists")
        for block_id in table:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        self._tables[holder_id] = list(table)

    def release(self, holder_id: str) -> None:
        """Release a holder's blocks; tail blocks first, so they are evicted first."""
        table = self._tables.pop(holder_id, None)
        self._num_hashed.pop(holder_id, None)
        if table is None:
            return
        blocks, free = self.blocks, self._free
        for block_id in reversed(table):
            block = blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                free[block_id] = None

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self._cached.items()):
            self.blocks[block_id].block_hash = None
        self._cached.clear()
        if self.tier is not None:
            self.tier.clear()

    # -- internals -----------------------------------------------------------------------------

    def _take_free_blocks(self, n: int) -> list[int]:
        """`n` blocks from the head of the free queue (the least recently freed first), each now
        held once; one that still named a cached prefix no longer does."""
        if n > len(self._free):
            raise NoFreeBlocksError("no free KV blocks")
        free, blocks, cached = self._free, self.blocks, self._cached
        taken = []
        for _ in range(n):  # the allocator's inner loop: locals only
            block_id = free.popitem(last=False)[0]
            block = blocks[block_id]
            if block.block_hash is not None:
                if cached.get(block.block_hash) == block_id:
                    del cached[block.block_hash]
                    if self.tier is not None:  # its prefix's KV is kept there, copied out now
                        self.tier.evicted(block.block_hash, block_id)
                block.block_hash = None
            block.ref_count = 1
            taken.append(block_id)
        return taken

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.token_ids(i * bs, (i + 1) * bs)))
