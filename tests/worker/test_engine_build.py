"""A worker builds its engine on a thread of its own that ends with the build: the engine thread's
OpenMP pool is then the process's only one, and a failed build still raises where it was asked."""

from __future__ import annotations

import threading

import pytest

from pdserve.worker import worker as worker_module
from pdserve.worker.config import WorkerConfig
from pdserve.worker.worker import Worker
from tests.worker.cluster import engine_config


def test_the_engine_is_built_on_a_thread_that_ends_with_the_build(tiny_llama, monkeypatch):
    built_on: list[threading.Thread] = []
    real = worker_module.LLMEngine

    def recording(*args, **kwargs):
        built_on.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(worker_module, "LLMEngine", recording)
    w = Worker(engine_config(tiny_llama, "both"), WorkerConfig(transfer="tcp"))
    try:
        assert built_on and built_on[0] is not threading.current_thread()
        assert not built_on[0].is_alive()
    finally:
        w.stop()


def test_a_build_that_fails_raises_in_the_caller(tiny_llama, monkeypatch):
    def failing(*args, **kwargs):
        raise MemoryError("no room for the KV cache")

    monkeypatch.setattr(worker_module, "LLMEngine", failing)
    with pytest.raises(MemoryError, match="no room"):
        Worker(engine_config(tiny_llama, "both"), WorkerConfig(transfer="tcp"))
