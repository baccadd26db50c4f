"""Hot-prefix replicas: the router's round that copies a hot prefix's KV to more decode workers
and lets the copies go as it cools (the seeds' read-only replicas of hot KV).

Routing prefers the decode worker whose prefix cache holds most of a prompt (`policy.choose_decode`),
so a burst on one shared prefix piles onto its first holder until that worker is hot. Each round
(about a second), for each prefix `HotPrefixes` tracks:
- fewer holders than it wants copies: the least loaded decode workers without it, cool and not
  draining, each get a copy. The router asks the worker for a one-token request of the prefix's
  tokens whose prompt comes from a holder (`prefill_url`, as hot-spot relief does): the holder reads
  the blocks from its prefix cache, computes at most the one token past them, and ships them through
  the transfer engine; they land in the copy's prefix cache like any prompt's. Nothing is computed
  twice. Once it answers, the prefix index says the worker holds the prefix and routing spreads the
  prefix's requests over its holders by load.
- more holders than it wants, with copies this round made: the most loaded copy is dropped. The
  index forgets the prefix there, so routing stops drawing its requests to that worker, whose prefix
  cache then lets the blocks go as it needs room (they are cached blocks no request holds).
A worker that shares a KV store with a holder holds the prefix already (a read away), and gets
no copy. A copy runs at the lowest client priority, at most one per worker at a time; one that fails is
logged and counted, and tried again a round later if the prefix is still hot.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import httpx
import msgspec

from pdserve import wire
from pdserve.limits import MAX_CLIENT_PRIORITY
from pdserve.router.hot_prefixes import HotPrefix, HotPrefixes
from pdserve.router.policy import decode_score
from pdserve.router.registry import WorkerEntry
from pdserve.router.routing import STORE_PREFIX

log = logging.getLogger("pdserve.router")

COPY_TIMEOUT_S = 60.0


class PrefixReplicas:
    def __init__(self, router, hot: HotPrefixes) -> None:
        self.router, self.hot = router, hot
        self.copies: dict[tuple[int, int], set[str]] = {}  # prefix key -> workers this round copied it to
        self.copying: set[str] = set()  # workers a copy is on its way to
        self.tasks: set[asyncio.Task] = set()

    def observe(self, prompt_ids: list[int], block_size: int, hashes: list[int]) -> None:
        """A prompt routed with these hashes (the decode worker's block size)."""
        self.hot.observe(prompt_ids, block_size, hashes, time.monotonic())

    @property
    def count(self) -> int:
        return sum(len(workers) for workers in self.copies.values())

    async def round(self) -> None:
        router = self.router
        decodes = {w.worker_id: w for w in router.registry.workers("decode", router.rollout.stable)
                   if not w.stats.draining}  # the stable version's: a copy serves what routing sends there
        for prefix, wanted in self.hot.tracked(time.monotonic()):
            copies = self.copies.setdefault(prefix.key, set())
            copies.intersection_update(decodes)  # a worker that left took its copy along
            holders = [w for w in decodes.values() if self._holds(w, prefix)]
            if holders and len(holders) < wanted:
                self._copy(prefix, holders, decodes, wanted - len(holders))
            elif len(holders) > max(1, wanted) and copies:
                self._drop(prefix, copies, decodes, len(holders) - max(1, wanted))
            if wanted == 0 and not copies:
                self.hot.forget(prefix)
                del self.copies[prefix.key]
        router.metrics.prefix_copies_held.set(self.count)

    def _holds(self, w: WorkerEntry, prefix: HotPrefix) -> bool:
        """In its own prefix cache, as far as the index knows, or in a KV store it shares (a read away)."""
        names = [w.worker_id] + ([STORE_PREFIX + w.stats.kv_store] if w.stats.kv_store else [])
        return w.block_size == prefix.block_size and any(
            self.router.index.cached_tokens(n, prefix.block_size, list(prefix.hashes)) >= prefix.num_tokens
            for n in names)

    def _copy(self, prefix: HotPrefix, holders: list[WorkerEntry], decodes: dict[str, WorkerEntry], n: int) -> None:
        weights = self.router.config.decode_weights
        held = {w.worker_id for w in holders}
        targets = sorted((w for k, w in decodes.items() if k not in held and k not in self.copying
                          and w.block_size == prefix.block_size and w.current_load().kv_usage <= weights.hot_kv_usage),
                         key=lambda w: (-decode_score(w.current_load(), weights), w.worker_id))[:n]
        source = max(holders, key=lambda w: (decode_score(w.current_load(), weights), w.worker_id))
        for target in targets:
            self.copying.add(target.worker_id)
            task = asyncio.create_task(self._copy_to(prefix, source, target))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _copy_to(self, prefix: HotPrefix, source: WorkerEntry, target: WorkerEntry) -> None:
        router = self.router
        body = wire.GenerateRequest(request_id=f"prefix-copy-{uuid.uuid4().hex[:12]}",
                                    prompt_token_ids=list(prefix.token_ids),
                                    sampling=wire.Sampling(max_tokens=1, temperature=0.0, ignore_eos=True),
                                    priority=MAX_CLIENT_PRIORITY, prefill_url=source.url, stream=False)
        try:
            r = await router.http.post(target.url + "/v1/generate", content=wire.encode(body),
                                       headers=router.worker_headers, timeout=COPY_TIMEOUT_S)
            lines = msgspec.json.decode(r.content) if r.status_code == 200 else None
            if not isinstance(lines, list) or any(not isinstance(x, dict) or "error" in x for x in lines):
                raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        except (httpx.HTTPError, msgspec.DecodeError, RuntimeError) as e:
            log.warning("hot prefix (%d tokens): copy from %s to %s failed: %s", prefix.num_tokens,
                        source.worker_id, target.worker_id, e)
            router.metrics.prefix_copies.labels("failed").inc()
            return
        finally:
            self.copying.discard(target.worker_id)
        if router.registry.get(target.worker_id) is not target:
            return  # it left meanwhile
        router.index.record(target.worker_id, prefix.block_size, list(prefix.hashes))
        self.copies.setdefault(prefix.key, set()).add(target.worker_id)
        router.metrics.prefix_copies.labels("copied").inc()
        router.metrics.prefix_copies_held.set(self.count)
        log.info("hot prefix (%d tokens, %.1f requests/s): copied from %s to %s", prefix.num_tokens,
                 self.hot.rate(prefix.block_size, prefix.hashes[-1], time.monotonic()), source.worker_id,
                 target.worker_id)

    def _drop(self, prefix: HotPrefix, copies: set[str], decodes: dict[str, WorkerEntry], n: int) -> None:
        weights = self.router.config.decode_weights
        for worker_id in sorted(copies, key=lambda k: (decode_score(decodes[k].current_load(), weights), k))[:n]:
            copies.discard(worker_id)
            self.router.index.forget_blocks(worker_id, prefix.block_size, list(prefix.hashes))
            self.router.metrics.prefix_copies.labels("dropped").inc()
            self.router.metrics.prefix_copies_held.set(self.count)
            log.info("hot prefix (%d tokens) cooled: %s no longer holds a copy for it", prefix.num_tokens, worker_id)
