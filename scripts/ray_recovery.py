"""How long `pdserve serve --ray` takes to start, to notice a lost decode node, to come back once a
node fits again, and to scale, on a four-node Ray cluster on this machine (every node on
127.0.0.1; `ray.cluster_utils.Cluster`), with the tiny model. Prints one line per step.

    .venv/bin/python scripts/ray_recovery.py [MODEL]      (needs the ray extra; MODEL: default tiny)

A measurement aid beside the tests in tests/on_ray/, which check the same steps' outcomes."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's nodes on loopback, not this host's address
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import httpx  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from tests.serve_process import ServeProcess  # noqa: E402

MODEL = sys.argv[1] if len(sys.argv) > 1 else "tiny"
NODE = dict(node_ip_address="127.0.0.1", num_cpus=1, object_store_memory=80 << 20)
t0 = time.monotonic()
c = Cluster(initialize_head=True, head_node_args=NODE)
pn = c.add_node(**NODE, resources={"prefill_node": 1})
dn = [c.add_node(**NODE, resources={"decode_node": 1}) for _ in range(2)]
print(f"4-node ray cluster up: {time.monotonic()-t0:.1f}s", flush=True)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
t1 = time.monotonic()
serve = ServeProcess("--ray", c.address, "--model", MODEL, "--port", str(port), "--decode", "2",
    "--transfer", "tcp", "--prefill-resources", '{"prefill_node": 1}', "--decode-resources", '{"decode_node": 1}',
    "--placement", "spread", "--migrate-on-failure", "--dtype", "float32", "--kv-cache-memory", "8MiB",
    env={**os.environ, "PDSERVE_TOKEN": "t" * 40})


def until(pred, what, limit=240):
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > limit: raise SystemExit(f"timeout: {what}: {serve.log[-10:]}")
        time.sleep(0.05)
    return time.monotonic()


until(lambda: serve.event("ready"), "ready")
print(f"serve --ray ready (router + 1P2D, placement group spread): {time.monotonic()-t1:.1f}s", flush=True)
ready = serve.event("ready"); url = ready["url"]
actors = {a["name"]: a for a in ready["actors"]}
lost = actors["decode worker 1"]
node = next(n for n in dn if n.node_id == lost["node_id"])
t2 = time.monotonic(); c.remove_node(node, allow_graceful=False); t2b = time.monotonic()
td = until(lambda: serve.event("actor_down", "decode worker 1"), "down")
tdrop = until(lambda: httpx.get(url + "/health").json()["workers"] == 2, "dropped")
print(f"remove_node took {t2b-t2:.1f}s; actor_down reported {td-t2:.1f}s after; router down to 2 workers {tdrop-t2:.1f}s after", flush=True)
t3 = time.monotonic(); c.add_node(**NODE, resources={"decode_node": 1}); t3b = time.monotonic()
tr = until(lambda: serve.event("actor_restarted", "decode worker 1"), "restarted")
treg = until(lambda: httpx.get(url + "/health").json()["workers"] == 3, "registered")
print(f"add_node took {t3b-t3:.1f}s; actor_restarted {tr-t3b:.1f}s after the node was up; registered {treg-t3b:.1f}s after", flush=True)
scale = [sys.executable, "-m", "pdserve.cli", "scale", "--ray", c.address]
for n in (1, 2):
    t = time.monotonic(); r = subprocess.run([*scale, "--decode", str(n)], capture_output=True, text=True)
    print(f"pdserve scale --decode {n}: rc {r.returncode} in {time.monotonic()-t:.1f}s", flush=True)
serve.close(); c.shutdown()
print("events:", [e["event"] + ":" + e.get("name", "") for e in serve.events], flush=True)
