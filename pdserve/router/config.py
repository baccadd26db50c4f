"""The router's settings, declared once. A field made with `flag` is also a flag of `pdserve router`
and of `pdserve serve`, which hands it to the router it starts (`flags.py`: the argparse group, the
config from parsed args, the router's argv, all from these fields). The rest are for library
users and tests; the model's name and context length come from the model, the keys from files or
the environment (`credentials.py`: never a command line)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.flags import check_flags, count, flag, fraction, milliseconds, per_second, seconds, weight
from pdserve.router.policy import DecodeWeights, DisaggregationPolicy, HotSpotRelief
from pdserve.router.rebalance import RebalancePolicy
from pdserve.router.tool_calls import PARSER_CHOICES
from pdserve.telemetry.tracing import otlp_endpoint
from pdserve.wire import version_label

_POLICY = RebalancePolicy()


@dataclass
class RouterConfig:
    model_name: str
    max_model_len: int
    api_key: str = ""
    worker_token: str = ""
    admin_key: str = ""  # the admin API's Bearer key; none: no admin API

    # -- flags -----------------------------------------------------------------------------------
    max_tokens_default: int = flag(1024, "max_tokens of a chat request that sets none (within the context the "
                                         "prompt leaves)", parse=count)
    lease_s: float = flag(10.0, "seconds a worker stays registered without a heartbeat", name="--lease",
                          parse=seconds)
    max_queued_requests: int = flag(1024, "requests the router holds at once; past it clients get 429", parse=count)
    queue_timeout_s: float = flag(300.0, "seconds an admitted request waits for a worker with room in its queue "
                                         "before a 503", name="--queue-timeout", parse=seconds)
    migrate_on_failure: bool = flag(False, "a decode worker lost mid-stream: continue on another by recomputing "
                                           "prompt + output")
    resume_wait_s: float = flag(30.0, "a decode worker whose KV outlives it (--durable-kv) lost mid-stream: seconds "
                                      "its streams wait for it to come back and resume from their KV", name="--resume-wait",
                                parse=seconds)
    migrate_hot_spots: bool = flag(True, "keep running requests where they are, however hot their decode worker",
                                   name="--no-hot-spot-migration")
    hot_kv_usage: float = flag(0.85, "KV use past which a decode worker gets no new work and running requests "
                                     "move off it", parse=fraction)
    prefix_affinity: float = flag(0.3, "score a decode worker gains for holding the whole prompt in its prefix cache "
                                       "(in proportion to the share it holds; the load terms sum to 1; 0: routing "
                                       "by load alone)", parse=weight)
    hot_prefix_rate: float = flag(2.0, "requests per second of one shared prompt prefix that each decode worker "
                                       "holding it serves: past it the prefix is copied to more decode workers, "
                                       "as it cools the copies go (0: no copies)", parse=per_second)
    controller: bool = flag(False, "the P:D controller: move workers between the prefill and decode pools as their "
                                   "pressure against the TTFT and TPOT targets says (off by default)",
                            name="--rebalance")
    rebalance_confirm_s: float = flag(_POLICY.confirm_s, "seconds a pool's need must hold before the controller "
                                                         "moves a worker", parse=seconds)
    rebalance_dwell_s: float = flag(_POLICY.dwell_s, "seconds after a move before the controller considers another",
                                    parse=seconds)
    slo_ttft_ms: float = flag(_POLICY.ttft_target_s * 1e3, "TTFT target: SLA attainment metrics, and the "
                                                           "controller's prefill pressure", parse=milliseconds)
    slo_tpot_ms: float = flag(_POLICY.tpot_target_s * 1e3, "TPOT target: SLA attainment metrics, and the "
                                                           "controller's decode pressure", parse=milliseconds)
    tool_call_parser: str = flag("auto", "how the model writes tool calls: hermes (<tool_call>), llama3_json, "
                                         "mistral ([TOOL_CALLS]); auto: the one its chat template shows",
                                 choices=PARSER_CHOICES)
    stable_version: str | None = flag(None, "the version label whose workers serve requests (default: the first "
                                            "registered worker's); a canary rollout moves traffic to another "
                                            "(`pdserve worker --version-label`)", parse=version_label)
    otlp_traces_endpoint: str = flag("", "send each request's spans to this OpenTelemetry collector (OTLP over "
                                         "HTTP, e.g. http://127.0.0.1:4318; `pip install pdserve[otel]`): the "
                                         "router's, and with `pdserve serve` its workers' too; off by default",
                                     parse=otlp_endpoint)

    # -- for library users and tests -------------------------------------------------------------
    disaggregation: DisaggregationPolicy = field(default_factory=DisaggregationPolicy)
    relief: HotSpotRelief = field(default_factory=HotSpotRelief)
    max_queued_tokens: int = 1 << 20
    max_body_bytes: int = 8 << 20
    keepalive_s: float = 5.0  # SSE comment after this long without a token
    worker_silence_s: float = 60.0  # a worker stream with no line (workers send keep-alives) for this long is lost
    client_stall_s: float = 30.0  # a client that reads nothing for this long, with output waiting, is dropped
    hot_prefix_window_s: float = 10.0  # a prefix's request rate is counted over about this long (decaying)

    # -- derived from the flags --------------------------------------------------------------------
    decode_weights: DecodeWeights = field(init=False)
    rebalance: RebalancePolicy | None = field(init=False)  # the P:D controller's policy; None: off

    def __post_init__(self) -> None:
        check_flags(self)
        self.decode_weights = DecodeWeights(hot_kv_usage=self.hot_kv_usage, prefix=self.prefix_affinity)
        self.rebalance = RebalancePolicy(self.ttft_slo_s, self.tpot_slo_s, self.hot_kv_usage,
                                         confirm_s=self.rebalance_confirm_s,
                                         dwell_s=self.rebalance_dwell_s) if self.controller else None

    @property
    def ttft_slo_s(self) -> float:
        return self.slo_ttft_ms / 1e3

    @property
    def tpot_slo_s(self) -> float:
        return self.slo_tpot_ms / 1e3
