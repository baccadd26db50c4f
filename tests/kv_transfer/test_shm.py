"""The shared-memory pool: what a prefill worker agrees to map, and pools of killed workers reaped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.kv_transfer.base import KVLayout, TransferError
from pdserve.kv_transfer.shm import SHM_DIR, SharedKVPool, map_peer_pool, shm_available

pytestmark = pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm")
LAYOUT = KVLayout("m", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32")


def test_the_peer_pool_maps_the_same_memory():
    pool = SharedKVPool((2, 8, 2, 1, 4), torch.float32)
    try:
        peer = map_peer_pool(pool.path, LAYOUT, 8)
        peer[1, 3] = 7.0
        assert torch.all(pool.tensor[1, 3] == 7.0)
    finally:
        pool.close()
    assert not os.path.exists(pool.path)


def test_only_a_pdserve_pool_of_the_right_size_is_mapped(tmp_path):
    pool = SharedKVPool((2, 8, 2, 1, 4), torch.float32)
    try:
        with pytest.raises(TransferError, match="has 512 bytes"):
            map_peer_pool(pool.path, LAYOUT, 16)
        other = tmp_path / "pdserve-kv-1-0123456789abcdef"
        other.write_bytes(bytes(512))
        link = os.path.join(SHM_DIR, f"pdserve-kv-{os.getpid()}-{'f' * 16}")
        os.symlink(other, link)
        try:
            for path in ["/etc/passwd", str(other), link, os.path.join(SHM_DIR, "something-else")]:
                with pytest.raises(TransferError, match="not a pdserve shared KV pool"):
                    map_peer_pool(path, LAYOUT, 8)
        finally:
            os.unlink(link)
    finally:
        pool.close()


def test_pools_of_dead_workers_are_reaped():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = os.path.join(SHM_DIR, f"pdserve-kv-{int(dead.stdout)}-{'a' * 16}")
    live = os.path.join(SHM_DIR, f"pdserve-kv-{os.getpid()}-{'b' * 16}")
    for path in (stale, live):
        open(path, "wb").close()
    try:
        pool = SharedKVPool((1, 4, 2, 1, 4), torch.float32)
        pool.close()
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)
