"""What the decode role touches of an engine, and nothing more: lease tests run it without a model."""

from __future__ import annotations

from types import SimpleNamespace


class FakeBlocks:
    def __init__(self) -> None:
        self.holders: set[str] = set()

    def hand_over(self, request_id: str, holder: str) -> None:
        self.holders.add(holder)

    def release(self, holder: str) -> None:
        self.holders.discard(holder)


class FakeEngine:
    """What DecodeRole touches of the engine when a lease ends."""

    def __init__(self) -> None:
        self.block_manager = FakeBlocks()
        self.model_config = SimpleNamespace(vocab_size=100)
        self.draft_model = None  # no draft model: no draft KV in the leases
        self.landed: list[tuple[str, int]] = []
        self.recomputed: list[str] = []

    def kv_landed(self, request_id: str, first_token: int, prefill_times, first_logprobs=None,
                  prompt_logprobs=None, head_feature=b"") -> None:
        self.landed.append((request_id, first_token))

    def kv_failed(self, request_id: str) -> None:
        self.recomputed.append(request_id)


class FakeRequest:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
