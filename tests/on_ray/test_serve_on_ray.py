"""`pdserve serve --ray` on a Ray cluster of four nodes on this machine (`ray.cluster_utils.Cluster`,
every node on 127.0.0.1): a head node for the router, a node marked `prefill_node` and two marked
`decode_node`. First, a small deployment of two routers (`--routers 2`) and one colocated worker
loses its leading router. Then one deployment (1P2D, each pool in a spread placement group, KV over tcp only) serves the module's scenarios in order:
placement and token-exact output, a decode worker's process killed mid-stream (its actor holds its
durable KV pool: the worker comes back in the actor and resumes its streams), a decode node lost
mid-stream (its requests recover, its actor comes back when a node fits again), and `pdserve scale`."""

from __future__ import annotations

import glob
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.factories import make_llm, offline_text
from tests.serve_process import ServeProcess
from tests.wait import wait_for

ray = pytest.importorskip("ray", reason="Ray is the `ray` extra (pip install 'pdserve[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402  (after the skip: Ray is optional)

TOKEN, ADMIN_KEY = "ray-test-token-" + "t" * 24, "ray-admin-" + "a" * 24
WORKER_AUTH = {"Authorization": f"Bearer {TOKEN}"}
NODE = dict(node_ip_address="127.0.0.1", num_cpus=1, object_store_memory=80 << 20)
# Ray otherwise gives its nodes this host's network address: the tests stay on loopback.
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture(scope="module")
def cluster():
    saved = {k: os.environ.get(k) for k in LOOPBACK_ONLY}
    os.environ.update(LOOPBACK_ONLY)
    c = Cluster(initialize_head=True, head_node_args=NODE)
    nodes = {"prefill": c.add_node(**NODE, resources={"prefill_node": 1}),
             "decode": [c.add_node(**NODE, resources={"decode_node": 1}) for _ in range(2)]}
    try:
        yield c, nodes
    finally:
        c.shutdown()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deployment(cluster, tiny_llama):
    c, _ = cluster
    serve = ServeProcess(
        "--ray", c.address, "--name", "test", "--model", str(tiny_llama), "--port", str(_free_port()),
        "--decode", "2", "--transfer", "tcp", "--prefill-resources", '{"prefill_node": 1}',
        "--decode-resources", '{"decode_node": 1}', "--placement", "spread", "--migrate-on-failure", "--dtype", "float32",
        "--durable-kv", "--resume-wait", "5",
        "--kv-cache-memory", "8MiB", "--block-size", "4", "--max-restart-backoff", "1",
        env={**os.environ, "PDSERVE_TOKEN": TOKEN, "PDSERVE_ADMIN_KEY": ADMIN_KEY})
    try:
        wait_for(lambda: serve.event("ready") or serve.proc.poll() is not None, 240, "the deployment",
                 state=lambda: serve.log[-10:])
        assert serve.event("ready"), serve.log[-20:]
        yield serve
    finally:
        serve.close()
    assert serve.proc.returncode == 0, serve.log[-20:]
    assert serve.event("stopped")


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return make_llm(tiny_llama)


def _actors(serve: ServeProcess) -> dict[str, dict]:
    return {a["name"]: a for a in serve.event("ready")["actors"]}


def _admin_workers(url: str) -> list[dict]:
    r = httpx.get(url + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    return r.json()["workers"]


def _long_prompt(llm, phrase: str, tokens: int = 300) -> str:
    """A prompt of at least `tokens` tokens: the router sends a prompt this long through a prefill
    worker (shorter ones decode workers prefill themselves)."""
    prompt = phrase
    while len(llm.get_tokenizer().encode(prompt)) < tokens:
        prompt += phrase
    return prompt


def _current_url(router_url: str, actor: dict) -> str:
    """The worker's address now: a worker started again in its actor listens on a new port."""
    node = f"ray-{actor['node_id'][:16]}"
    return next(w["url"] for w in _admin_workers(router_url) if w["node"] == node)


def _idle(worker_url: str) -> bool:
    s = httpx.get(worker_url + "/stats", headers=WORKER_AUTH).json()
    return s["running"] == s["waiting"] == s["waiting_for_kv"] == s["kv_blocks_used"] == 0


def test_two_routers_on_nodes_of_their_own_one_killed(cluster, tiny_llama):
    """Run first, on the free head node's CPU: `--routers 2` puts router 0 on the head node and
    router 1 on another, each worker registered with both; router 0 killed, the shared address
    (every node here is 127.0.0.1: SO_REUSEPORT) is served by router 1; router 0 comes back on its
    node and address, registered with the worker again, and leads again."""
    c, _ = cluster
    port = _free_port()
    serve = ServeProcess(
        "--ray", c.address, "--name", "replicas", "--model", str(tiny_llama), "--port", str(port), "--routers", "2",
        "--prefill", "0", "--decode", "0", "--colocated", "1", "--transfer", "tcp", "--dtype", "float32",
        "--kv-cache-memory", "8MiB", "--block-size", "4", "--max-restart-backoff", "0.5",
        env={**os.environ, "PDSERVE_TOKEN": TOKEN, "PDSERVE_ADMIN_KEY": ADMIN_KEY})
    try:
        wait_for(lambda: serve.event("ready") or serve.proc.poll() is not None, 240, "the deployment",
                 state=lambda: serve.log[-10:])
        ready = serve.event("ready")
        assert ready, serve.log[-20:]
        actors = _actors(serve)
        assert actors["router 0"]["node_id"] == c.head_node.node_id
        assert actors["router 1"]["node_id"] != c.head_node.node_id  # a node of its own
        own = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]

        def health(i: int) -> dict | None:
            try:
                return httpx.get(own[i] + "/health", timeout=2).json()
            except httpx.HTTPError:
                return None
        wait_for(lambda: [(h or {}).get("workers") for h in map(health, (0, 1))] == [1, 1], 30,
                 "the worker registered with both routers")
        wait_for(lambda: [(h or {}).get("leading") for h in map(health, (0, 1))] == [True, False], 30,
                 "router 0 leading", state=lambda: [health(0), health(1)])
        client = openai.OpenAI(base_url=ready["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)
        os.kill(actors["router 0"]["pid"], signal.SIGKILL)
        # from when its own port refuses: its sockets are closed then (a connection the kernel gave its
        # public listener before that was its own, in flight at the kill)
        wait_for(lambda: health(0) is None, 10, "router 0's sockets closed")
        for i in range(5):  # begun after the kill: router 1 answers on the shared address
            client.completions.create(model=ready["model"], prompt=f"after the kill {i}", max_tokens=4,
                                      temperature=0)
        wait_for(lambda: serve.event("ready_again", "router 0"), 60, "router 0 back in its actor",
                 state=lambda: serve.log[-5:])
        wait_for(lambda: [(h or {}).get("leading") for h in map(health, (0, 1))] == [True, False], 30,
                 "router 0 leading again", state=lambda: [health(0), health(1)])
        assert health(0)["workers"] == 1
    finally:
        serve.close()
    assert serve.proc.returncode == 0, serve.log[-20:]


def test_one_prefill_two_decode_on_their_nodes_token_exact_over_tcp(cluster, deployment, offline):
    _, nodes = cluster
    actors, url = _actors(deployment), deployment.event("ready")["url"]
    prefill, decodes = actors["prefill worker 0"], [actors["decode worker 1"], actors["decode worker 2"]]
    assert prefill["node_id"] == nodes["prefill"].node_id
    assert sorted(d["node_id"] for d in decodes) == sorted(n.node_id for n in nodes["decode"])
    assert actors["router"]["node_id"] == cluster[0].head_node.node_id
    for a in actors.values():  # the token reached every process, in its environment, not on its command line
        assert TOKEN.encode() not in Path(f"/proc/{a['pid']}/cmdline").read_bytes()
        assert f"PDSERVE_TOKEN={TOKEN}".encode() in Path(f"/proc/{a['pid']}/environ").read_bytes().split(b"\0")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    prompts = [_long_prompt(offline, f"request {i} on the ray cluster ") for i in range(3)]
    for prompt in prompts:
        r = client.completions.create(model=deployment.event("ready")["model"], prompt=prompt, max_tokens=12,
                                      temperature=0)
        assert r.choices[0].text == offline_text(offline, prompt, 12)
    sent = httpx.get(prefill["url"] + "/stats", headers=WORKER_AUTH).json()["kv_bytes_sent"]
    assert sent > 0  # every prompt's KV crossed between nodes, and tcp was the only backend offered
    shown = {w["url"]: w["node"] for w in _admin_workers(url)}
    assert shown == {a["url"]: f"ray-{a['node_id'][:16]}" for a in (prefill, *decodes)}
    for d in decodes:
        wait_for(lambda: _idle(d["url"]), 30, "the decode workers to hold nothing")


def _streams(client: openai.OpenAI, model: str, prompts: list[str], max_tokens: int):
    """Streamed completions on threads: (threads, texts by prompt, a semaphore released at each first
    token, errors)."""
    texts, firsts, errors = {}, threading.Semaphore(0), []

    def stream(prompt: str) -> None:
        try:
            parts = []
            for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                if not parts:
                    firsts.release()
                parts.append(chunk.choices[0].text)
            texts[prompt] = "".join(parts)
        except BaseException as e:  # read by the test: a stream that failed fails it
            errors.append(e)
            firsts.release()

    threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for _ in prompts:
        assert firsts.acquire(timeout=60), "a stream got no first token"
    return threads, texts, errors


def test_a_killed_decode_worker_resumes_from_the_pool_its_actor_holds(deployment, offline):
    actors, url, model = _actors(deployment), deployment.event("ready")["url"], deployment.event("ready")["model"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [f"a story that goes on, number {i}" for i in range(3)]
    threads, texts, errors = _streams(client, model, prompts, 400)
    running = {name: httpx.get(actors[name]["url"] + "/stats", headers=WORKER_AUTH).json()["running"]
               for name in ("decode worker 1", "decode worker 2")}
    victim = actors[max(running, key=running.get)]
    assert glob.glob("/dev/shm/pdserve-kv-*")  # the actors' pools
    os.kill(victim["pid"], signal.SIGKILL)  # the worker process; its actor (and the pool it holds) live on
    for t in threads:
        t.join(180)
        assert not t.is_alive(), "a stream never ended"
    assert not errors, errors
    for prompt in prompts:
        assert texts[prompt] == offline_text(offline, prompt, 400, ignore_eos=True)
    metrics = httpx.get(url + "/metrics").text
    resumed = float(re.search(r'pdserve_migrations_total\{reason="resumed"\} (\S+)', metrics).group(1))
    assert resumed == max(running.values()), metrics  # each of its streams, from its KV
    wait_for(lambda: httpx.get(url + "/health").json()["workers"] == 3, 60, "the worker back in its actor")


def test_a_lost_decode_node_loses_no_request_and_its_worker_comes_back(cluster, deployment, offline):
    c, nodes = cluster
    actors, url, model = _actors(deployment), deployment.event("ready")["url"], deployment.event("ready")["model"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [f"a long answer number {i}" for i in range(4)]
    threads, texts, errors = _streams(client, model, prompts, 600)
    lost = actors["decode worker 1"]
    node = next(n for n in nodes["decode"] if n.node_id == lost["node_id"])
    c.remove_node(node, allow_graceful=False)  # the machine is gone: its raylet, actors and their children
    for t in threads:
        t.join(180)
        assert not t.is_alive(), "a stream never ended"
    assert not errors, errors
    for prompt in prompts:  # recomputed on the surviving decode worker where needed: the same tokens
        assert texts[prompt] == offline_text(offline, prompt, 600, ignore_eos=True)
    wait_for(lambda: not Path(f"/proc/{lost['pid']}").exists(), 30, "the lost node's worker process to be gone")
    wait_for(lambda: deployment.event("actor_down", "decode worker 1"), 30, "the actor reported down")
    nodes["decode"] = [n for n in nodes["decode"] if n is not node] + [c.add_node(**NODE, resources={"decode_node": 1})]
    wait_for(lambda: deployment.event("actor_restarted", "decode worker 1"), 120, "the actor on the new node",
             state=lambda: deployment.log[-5:])
    back = deployment.event("actor_restarted", "decode worker 1")
    assert back["node_id"] == nodes["decode"][-1].node_id
    wait_for(lambda: httpx.get(url + "/health").json()["workers"] == 3, 60, "the new decode worker registered")
    survivor = _current_url(url, actors["decode worker 2"])  # it may have been started again in its actor
    wait_for(lambda: _idle(survivor), 30, "the surviving decode worker to hold nothing")


def test_scale_drains_and_adds_workers(deployment):
    url = deployment.event("ready")["url"]
    scale = [sys.executable, "-m", "pdserve.cli", "scale", "--ray", deployment_address(deployment), "--name", "test"]
    down = subprocess.run([*scale, "--decode", "1"], capture_output=True, text=True, timeout=180)
    assert down.returncode == 0, down.stderr
    assert httpx.get(url + "/health").json()["roles"] == {"prefill": 1, "decode": 1, "both": 0}
    # the deployment reports on its own output, read on a thread: the command may return first
    wait_for(lambda: deployment.event("removed"), 30, "the deployment to report the removal")
    assert deployment.event("removed")["name"] == "decode worker 2"  # the newest goes first
    assert deployment.event("draining", "decode worker 2")  # it finished its requests and left first
    up = subprocess.run([*scale, "--decode", "2"], capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stderr
    wait_for(lambda: deployment.event("added"), 30, "the deployment to report the new worker")
    added = deployment.event("added")
    assert added["name"] == "decode worker 3"  # in the bundle, and on the node, the removed one left free
    assert httpx.get(url + "/health").json()["roles"] == {"prefill": 1, "decode": 2, "both": 0}
    refused = subprocess.run([*scale, "--prefill", "0", "--decode", "0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "at least one worker" in refused.stderr
    full = subprocess.run([*scale, "--decode", "3", "--timeout", "5"], capture_output=True, text=True, timeout=120)
    assert full.returncode == 2 and "no placement of 1 more decode workers" in full.stderr  # no third decode node
    assert httpx.get(url + "/health").json()["roles"] == {"prefill": 1, "decode": 2, "both": 0}  # left as it was
    missing = subprocess.run([*scale[:-1], "nobody", "--decode", "1"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no pdserve deployment named 'nobody'" in missing.stderr


def deployment_address(serve: ServeProcess) -> str:
    return serve.proc.args[serve.proc.args.index("--ray") + 1]
