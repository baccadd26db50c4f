"""KV that survives its worker: a decode worker's pool in a shared-memory file its supervisor keeps,
and a journal of what each running request's blocks hold, so that a restarted worker resumes its
requests from their KV instead of computing them again.

Lifecycle of a durable pool (`pdserve serve --durable-kv` names one a decode worker):
1. `allocate`: the worker maps the pool file; one of the right size that a journal of the same
   layout describes is attached as it is (the crashed worker's KV), anything else is made afresh.
   Each attach is a generation: the journal's number plus one.
2. `recover`: each journaled request is checked: its record's CRC, and the CRC-32 of every block
   over the positions it claimed. What passes is held (`BlockManager.hold`) for its request to
   come back for, until `claim_window_s` passes; what fails is dropped and counted, and its
   request computes its KV again when it comes: inconsistent KV is never served. A worker that holds
   requests to resume skips its warm-up (their streams would wait seconds for it).
3. `tick` (the engine thread, between steps): the running requests' block tables, tokens and
   checksums are written at once when a request starts running, else at most every `interval_s`
   while any runs; atomically (a whole file renamed into place), so a crash leaves the previous
   journal or this one, never half of one. A full block's checksum is taken once.
4. `claim`: a request the router resumes (`resume_of`: its id before the crash) adopts the held
   blocks of that id when the journaled tokens are its own first tokens; it computes only the
   tokens after them (those generated after the last journal write).

The pool file is named like a shared KV pool (`kv_transfer/shm.py`) after its supervisor's process,
so a same-host prefill worker writes into it as into any, and a pool whose supervisor is gone is
reaped. On CUDA the device memory dies with the process: there, the host tier keeps what was evicted,
and a crash's running requests are recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import zlib
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.wire import SHM_DIR

log = logging.getLogger("pdserve.engine")

JOURNAL_VERSION = 1
HOLDER_PREFIX = "resume:"


def journal_path(pool_path: str) -> str:
    """The journal beside its pool: /dev/shm/pdserve-kv-P-H -> /dev/shm/pdserve-kvj-P-H."""
    head, name = os.path.split(pool_path)
    return os.path.join(head, name.replace("pdserve-kv-", "pdserve-kvj-", 1))


def durable_pool(name: str | None, config: EngineConfig) -> DurableKV | None:
    """The durable pool a worker's `--durable-kv` names, under /dev/shm (CPU only: device memory
    does not outlive its process)."""
    if name is None:
        return None
    if config.device != "cpu":
        log.warning("--durable-kv keeps a CPU pool; on %s a restarted worker recomputes its requests (the host "
                    "tier keeps what was evicted)", config.device)
        return None
    return DurableKV(os.path.join(SHM_DIR, name), f"{config.model}|{config.block_size}")


def block_crc(kv: torch.Tensor, block_id: int, block_size: int, positions: int) -> int:
    """CRC-32 of the first `positions` slots of a block, every layer (the pool is [layers, slots, ...])."""
    start = block_id * block_size
    part = kv[:, start : start + positions].contiguous()
    return zlib.crc32(part.view(torch.uint8).numpy())


@dataclass(slots=True)
class Held:
    """A journaled request whose KV checked out: its blocks held until it comes back or `deadline`."""

    tokens: list[int]
    deadline: float


class DurableKV:
    def __init__(self, pool_path: str, fingerprint: str, interval_s: float = 0.25,
                 claim_window_s: float = 60.0) -> None:
        self.pool_path, self.journal_path = pool_path, journal_path(pool_path)
        self.fingerprint = fingerprint  # the model, dtype, block size and pool shape the KV was made by
        self.interval_s, self.claim_window_s = interval_s, claim_window_s
        self.identity = hashlib.sha256(os.path.basename(pool_path).encode()).hexdigest()[:16]  # for the router
        self.generation = 1
        self.reattached = False
        self.kv: torch.Tensor | None = None
        self.blocks: BlockManager | None = None  # the engine's, from `recover` on
        self.held: dict[str, Held] = {}
        self._pending: list = []  # the journal's records found at `allocate`, checked by `recover`
        self._records: dict[str, dict] = {}  # journaled: request id -> record (held ones too)
        self._full_crcs: dict[str, list[int]] = {}  # a running request's full blocks' checksums
        self._written: dict[str, int] = {}  # request id -> tokens journaled, as last written
        self._last_write = 0.0
        # counters, for the worker's stats
        self.resumed_requests = 0
        self.rejected_records = 0  # journaled requests whose KV did not check out
        self.recomputed_prompt_tokens = 0  # prompt tokens a resumed request computed again
        self.journal_writes = 0

    # -- start ---------------------------------------------------------------------------------

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The pool: the one found (same size, a journal of this layout) or a fresh one."""
        self.fingerprint = f"{self.fingerprint}|{tuple(shape)}|{dtype}"
        numel = 1
        for d in shape:
            numel *= d
        journal = self._read_journal()
        size = os.path.getsize(self.pool_path) if os.path.exists(self.pool_path) else -1
        self.reattached = journal is not None and size == numel * dtype.itemsize
        if not self.reattached:
            fd = os.open(self.pool_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.close(fd)
        self.generation = (journal["generation"] + 1) if self.reattached else 1
        self._pending = journal["records"] if self.reattached else []
        self.kv = torch.from_file(self.pool_path, shared=True, size=numel, dtype=dtype).view(shape)
        return self.kv

    def _read_journal(self) -> dict | None:
        try:
            with open(self.journal_path, "rb") as f:
                journal = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("durable KV: the journal %s is unreadable (%s); every request computes again",
                        self.journal_path, e)
            return None
        ok = (isinstance(journal, dict) and journal.get("version") == JOURNAL_VERSION
              and journal.get("layout") == self.fingerprint and type(journal.get("generation")) is int
              and isinstance(journal.get("records"), list))
        if not ok:
            log.warning("durable KV: the journal %s is of another layout or version; the pool starts afresh",
                        self.journal_path)
        return journal if ok else None

    def recover(self, blocks: BlockManager) -> None:
        """Hold the blocks of each journaled request whose KV checks out (see the module docstring)."""
        self.blocks = blocks
        deadline = time.monotonic() + self.claim_window_s
        for entry in self._pending:
            record = self._checked(entry, blocks)
            if record is None:
                self.rejected_records += 1
                continue
            rid = record["id"]
            blocks.hold(HOLDER_PREFIX + rid, record["blocks"])
            self.held[rid] = Held(record["tokens"], deadline)
            self._records[rid] = record
        self._pending = []
        if self.held or self.rejected_records:
            log.info("durable KV: generation %d holds %d requests' KV for them to resume (%d rejected)%s",
                     self.generation, len(self.held), self.rejected_records,
                     "; a worker serves them before any warm-up" if self.held else "")
        self._write()  # this generation's journal, before anything runs

    def _checked(self, entry: object, blocks: BlockManager) -> dict | None:
        try:
            body, crc = entry["body"], entry["crc"]
            if zlib.crc32(body.encode()) != crc:
                raise ValueError("the record's checksum does not match")
            record = json.loads(body)
            rid, tokens, table, crcs = record["id"], record["tokens"], record["blocks"], record["crcs"]
            bs = blocks.block_size
            if (not isinstance(rid, str) or rid in self.held or not tokens or len(table) != blocks.blocks_needed(len(tokens))
                    or len(crcs) != len(table)
                    or not all(type(b) is int and 0 <= b < blocks.num_blocks for b in table)):
                raise ValueError("the record is malformed")
            for i, (block_id, expected) in enumerate(zip(table, crcs)):
                if block_crc(self.kv, block_id, bs, min(bs, len(tokens) - i * bs)) != expected:
                    raise ValueError(f"block {block_id} does not hold what was journaled")
            return record
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            log.warning("durable KV: a journaled request is not resumed: %s", e)
            return None

    # -- while serving -------------------------------------------------------------------------

    def tick(self, running: list[Request]) -> None:
        """Journal the running requests' KV when one started running, or `interval_s` after the
        last write if any computed more."""
        state = self._state(running)
        started = any(rid not in self._written for rid in state)
        if started or (state != self._written and time.monotonic() - self._last_write >= self.interval_s):
            self._journal(running, state)

    def close(self, running: list[Request]) -> None:
        """The worker stops: journal what still runs (its streams may come back to a restarted
        worker), and nothing of what finished."""
        self._journal(running, self._state(running))

    @staticmethod
    def _state(running: list[Request]) -> dict[str, int]:
        return {r.request_id: r.num_computed_tokens for r in running
                if r.status == RequestStatus.RUNNING and r.num_computed_tokens}

    def _journal(self, running: list[Request], state: dict[str, int]) -> None:
        for rid in [r for r in self._records if r not in state and r not in self.held]:
            del self._records[rid]
        self._full_crcs = {rid: crcs for rid, crcs in self._full_crcs.items() if rid in state}
        by_id = {r.request_id: r for r in running}
        for rid, n in state.items():
            self._records[rid] = self._record(by_id[rid], n)
        self._written = state
        self._write()

    def _record(self, req: Request, n: int) -> dict:
        bs, kv = self.blocks.block_size, self.kv
        table = self.blocks.block_table(req.request_id)[: -(-n // bs)]
        full = self._full_crcs.setdefault(req.request_id, [])
        while len(full) < n // bs:
            full.append(block_crc(kv, table[len(full)], bs, bs))
        crcs = full + ([block_crc(kv, table[-1], bs, n % bs)] if n % bs else [])
        return {"id": req.request_id, "tokens": req.token_ids(0, n), "blocks": table, "crcs": crcs}

    def _write(self) -> None:
        records = []
        for record in self._records.values():
            body = json.dumps(record, separators=(",", ":"))
            records.append({"body": body, "crc": zlib.crc32(body.encode())})
        data = json.dumps({"version": JOURNAL_VERSION, "layout": self.fingerprint, "generation": self.generation,
                           "records": records}, separators=(",", ":")).encode()
        tmp = f"{self.journal_path}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.journal_path)
        self._last_write = time.monotonic()
        self.journal_writes += 1

    def expire(self) -> None:
        """Release what no request came back for in time."""
        now = time.monotonic()
        for rid in [rid for rid, h in self.held.items() if h.deadline < now]:
            self._drop(rid)
            log.info("durable KV: request %s did not come back; its KV is released", rid)

    def _drop(self, rid: str) -> None:
        del self.held[rid]
        self._records.pop(rid, None)
        self.blocks.release(HOLDER_PREFIX + rid)

    # -- a request comes back ------------------------------------------------------------------

    def claim(self, req: Request, budget: int) -> int | None:
        """Tokens of `req` whose KV its held blocks give it (0: none held for it, or not its tokens,
        which are then released); None: held, but too few free blocks for the rest yet. A request
        always computes its last token again (its logits are what comes next)."""
        rid, blocks = req.resume_of, self.blocks
        held = self.held.get(rid)
        n = min(len(held.tokens), req.num_tokens - 1) if held is not None else 0
        if n < 1 or held.tokens[:n] != req.token_ids(0, n):
            if held is not None:
                self._drop(rid)
            self.recomputed_prompt_tokens += req.num_prompt_tokens
            req.resume_of = None
            return 0
        more = min(req.num_tokens - n, budget)
        table = blocks.block_table(HOLDER_PREFIX + rid)
        if blocks.blocks_needed(n + more) - len(table) > blocks.num_free_blocks:
            return None
        del self.held[rid]
        self._records.pop(rid, None)
        blocks.hand_over(HOLDER_PREFIX + rid, req.request_id)
        req.num_computed_tokens = n
        if not blocks.allocate(req, more):
            raise AssertionError("a resumed request's blocks were counted free and are not")
        req.resume_of = None
        self.resumed_requests += 1
        self.recomputed_prompt_tokens += max(0, req.num_prompt_tokens - n)
        return n

    def stats(self) -> dict[str, int]:
        return {"kv_pool_generation": self.generation, "kv_resumed_requests": self.resumed_requests,
                "kv_resume_rejected": self.rejected_records, "kv_resume_recomputed_prompt_tokens":
                self.recomputed_prompt_tokens, "kv_resumable": len(self.held)}
