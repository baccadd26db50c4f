"""Prefix hashes of token blocks: the names under which engines cache KV blocks and the router
remembers what each worker holds. One module, free of the engine and of torch, so that both
sides compute the very same values.

A block's hash covers its tokens and, through its parent's hash, every token before it: two
prompts share a block hash only if they share the whole prefix up to that block's end.
"""

from __future__ import annotations

import hashlib
from array import array


def hash_block(parent_hash: int | None, token_ids: list[int]) -> int:
    """Content hash of a full block, chained to the hash of the block before it.

    A cryptographic hash, so that no prompt can be crafted to collide with another user's prefix.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update((parent_hash or 0).to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained hashes of the full blocks of `token_ids` (a partial last block has none)."""
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        out.append(hash_block(out[-1] if out else None, token_ids[start : start + block_size]))
    return out
