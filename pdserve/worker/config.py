"""A worker's own settings (its engine's are `EngineConfig`): where it listens and what it tells
peers, how KV reaches it, how much it queues, whom it registers with, how long it drains. Each
field is also its `pdserve worker` flag (`flags.py`): the command line, `Worker`, and the argv
`pdserve serve` starts a worker with all read this one declaration. The worker's token is not
here: a secret never travels on a command line (`credentials.py`)."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

from pdserve.flags import check_flags, flag, host_name, port_number, seconds
from pdserve.router_addresses import check as check_routers
from pdserve.telemetry.tracing import otlp_endpoint
from pdserve.wire import KV_TRANSFER_DTYPES, NODE_NAME, SHM_POOL_NAME, version_label


def durable_pool_name(text: str) -> str:
    if not re.fullmatch(SHM_POOL_NAME, text):
        raise ValueError(f"expected a pool file name pdserve-kv-<pid>-<16 hex digits>, got {text!r}")
    return text


def router_spec(text: str) -> str:
    check_routers(text)
    return text


def node_name(text: str) -> str:
    if not re.fullmatch(NODE_NAME, text):
        raise ValueError(f"expected up to 128 letters, digits and _.:@-, got {text!r}")
    return text


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    host: str = flag("127.0.0.1", "address of the control endpoint and KV port", parse=host_name)
    advertise_host: str | None = flag(
        None, "address the router and peers are told to reach this worker at (default: --host); with --host "
              "0.0.0.0 in Kubernetes, the pod's IP (the downward API's status.podIP)", parse=host_name)
    node_name: str | None = flag(
        None, "the machine this worker runs on, as the router's /admin/workers shows it (default: the host name; "
              "on Ray, the Ray node)", parse=node_name)
    port: int = flag(8100, "control endpoint port (0: any free one)", parse=port_number)
    version: str = flag("", "the version this worker serves (a build or a model, e.g. v2): the router keeps each "
                            "version's requests and KV among its own workers, and a canary or shadow rollout names "
                            "one (`docs/operations.md`)", name="--version-label", parse=version_label)
    kv_port: int = flag(0, "decode: KV transfer port (0: any free one)", parse=port_number)
    transfer: str = flag("shm,tcp", "KV transfer backends in order of preference: nixl, tcp, shm (comma-separated)")
    kv_transfer_dtype: str = flag("auto", "decode: ask prefill workers to send KV quantized (tcp, nixl)",
                                  choices=KV_TRANSFER_DTYPES)
    kv_lease_timeout: float = flag(30.0, "decode: seconds to wait for a prompt's KV before computing it here",
                                   parse=seconds)
    max_queued: int = flag(256, "sequences waiting beyond a full batch (--max-num-seqs) before new requests are "
                                "refused (503)")
    record_steps: str | None = flag(None, "append every engine step's shape and time to this JSONL file (for "
                                          "`pdserve profile --from-steps`)")
    router: str | None = flag(None, "register with this router (or each of several, comma-separated: router "
                                    "replicas at their own addresses; dns+http://NAME:PORT: every address NAME "
                                    "resolves to, looked up again every 5 s) and renew the lease by heartbeat",
                              parse=router_spec)
    drain_timeout: float = flag(60.0, "seconds a worker sent SIGTERM finishes its requests before it stops anyway",
                                parse=seconds)
    durable_kv: str | None = flag(
        None, "decode: keep the KV pool in this shared-memory file (/dev/shm/pdserve-kv-<supervisor pid>-<16 hex>, "
              "which its supervisor keeps and removes) with a journal of the running requests' blocks, so a "
              "restarted worker resumes them from their KV (`pdserve serve --durable-kv` names one)",
        parse=durable_pool_name)
    otlp_traces_endpoint: str = flag("", "send each request's spans to this OpenTelemetry collector (OTLP over "
                                         "HTTP, e.g. http://127.0.0.1:4318; `pip install pdserve[otel]`); off by "
                                         "default", parse=otlp_endpoint)
    fault_injection: bool = flag(False, "serve POST /v1/faults/cut-kv-links (with the token): a testing aid that "
                                        "closes every KV connection of this worker at once; off by default")

    def __post_init__(self) -> None:
        check_flags(self)
        if not self.backends:
            raise ValueError(f"transfer names no backend: {self.transfer!r}")
        if self.kv_transfer_dtype not in KV_TRANSFER_DTYPES:
            raise ValueError(f"kv_transfer_dtype must be one of {', '.join(KV_TRANSFER_DTYPES)}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")

    @property
    def backends(self) -> list[str]:
        """`transfer` as a list, in order of preference."""
        return [t.strip() for t in self.transfer.split(",") if t.strip()]

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def node(self) -> str:
        """The node name the router shows: given, or this machine's host name as a node name can
        hold it (any other character becomes '-')."""
        return self.node_name if self.node_name is not None else this_host()


def this_host() -> str:
    return re.sub(r"[^A-Za-z0-9_.:@\-]", "-", socket.gethostname())[:128]

