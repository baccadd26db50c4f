"""One pdserve process (the router or a worker) as a Ray actor, on the node its resources chose.

Lifecycle:
1. Ray places the actor. It starts `pdserve router|worker` as a child process, its argv's
   `{node_ip}` and `{node}` filled in with this node's address and name (so the child binds and
   advertises an address its peers on other nodes can reach), and the cluster's secrets in the
   child's environment, never on its command line.
2. It keeps the child running under the launcher's supervisor and restart policy: a child that
   exits is started again after the same backoff; a crash loop is reported, never given up on.
3. Should the actor itself die (its node lost, its raylet gone), the child dies with it (SIGKILL:
   Ray starts the actor again on a node that fits, up to its restart limit, and a second copy
   must not linger). That is step 1 again, on the new node, with a new `incarnation`.
   A decode worker with a durable KV pool (`pdserve serve --ray --durable-kv`) has it named by its
   actor (`{durable_kv}` in its argv), after the actor's process: the actor holds it, so a child
   that crashes and is started again in the actor finds its KV and resumes its requests, as under
   `pdserve serve`. An actor that dies takes the pool's node-local file with it (reaped there); its
   new incarnation starts a new pool.
4. `drain()`: SIGTERM to the child, which finishes its requests, leaves the router and exits 0,
   and is not started again. `stop()`: every child stopped, SIGKILL after a grace period; the
   durable pool removed.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time

from pdserve.launcher import durable_pool_name, remove_durable_pools
from pdserve.supervisor import RestartPolicy, Supervisor

DURABLE_PLACEHOLDER = "{durable_kv}"


class ProcessActor:
    """Used as `ray.remote(ProcessActor)`; every method returns plain data."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], policy: dict) -> None:
        import ray

        self.name = name
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.incarnation = secrets.token_hex(6)  # another after Ray restarts this actor
        self.pools = [durable_pool_name()] if DURABLE_PLACEHOLDER in argv else []  # after this process
        self.argv = [a.replace("{node_ip}", self.node_ip).replace("{node}", f"ray-{self.node_id[:16]}")
                     .replace(DURABLE_PLACEHOLDER, self.pools[0] if self.pools else "") for a in argv]
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._started = threading.Event()
        self.sup = Supervisor({**os.environ, **env}, RestartPolicy(**policy), self._record,
                              death_signal=signal.SIGKILL)
        # The child's death signal follows the thread that started it: this one lives as long as the actor.
        threading.Thread(target=self._supervise, name="supervise", daemon=True).start()
        self._started.wait()

    def _record(self, event: dict) -> None:
        with self._lock:
            self._events.append({**event, "name": self.name})

    def _supervise(self) -> None:
        self.member = self.sup.start(self.name, self.argv)
        self._started.set()
        while not self.sup.stopping:
            self.sup.check()
            time.sleep(0.2)

    def ready(self, timeout: float) -> dict:
        """Once the child has printed its ready line: where it is, and on which node."""
        info = self.member.child.wait_ready(timeout)
        return {**self.status(0), "load_seconds": info.get("load_seconds")}

    def status(self, since: int) -> dict:
        """Where this actor runs, its child now, and the events from number `since` on."""
        child = self.member.child
        with self._lock:
            events = self._events[since:]
        return {"incarnation": self.incarnation, "node_id": self.node_id, "node_ip": self.node_ip,
                "pid": child.proc.pid if child else None, "url": (child.ready or {}).get("url") if child else None,
                "alive": bool(child and child.alive), "restarts": self.member.restarts,
                "retired": self.member.retired, "events": events}

    def drain(self, timeout: float) -> int | None:
        """SIGTERM to the child (a worker drains), never restarted; its exit code, or None if it is
        still running after `timeout` seconds."""
        self.sup.retire(self.member)
        try:
            code = self.member.child.proc.wait(timeout)
        except subprocess.TimeoutExpired:  # the caller decides what comes next
            return None
        remove_durable_pools(self.pools)  # drained: nothing in it waits to resume
        return code

    def stop(self, grace_s: float) -> None:
        self.sup.stop(grace_s)
        remove_durable_pools(self.pools)
