"""The operator's Grafana dashboard of a cluster, built from code with Grafana's own SDK (the
`dashboards` extra), over the router's /metrics alone: the router reports every worker's load
from its heartbeats, so one scrape job shows the whole cluster.

Rows: latency (percentiles of TTFT, TPOT, end to end, and the p95 of each phase), SLA (attainment,
goodput, outcomes, errors), pools (workers by role, each worker's batch and queue, the decode
waiting share, KV use per pool), KV (use per worker, transfer bandwidth and its share of TTFT,
prompts landed or recomputed), changes (rebalances, restarts, drops, migrations).

`pdserve dashboard --out deploy/grafana/pdserve-overview.json` writes it; a test checks that the
committed file is what this builds and that every series it asks for is one the router exports.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

try:  # the `dashboards` extra
    from grafana_foundation_sdk.builders.common import GraphThresholdsStyleConfig, StackingConfig
    from grafana_foundation_sdk.builders.dashboard import (Dashboard, DatasourceVariable, QueryVariable, Row,
                                                           ThresholdsConfig)
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.common import GraphDrawStyle, GraphThresholdsStyleMode, StackingMode
    from grafana_foundation_sdk.models.dashboard import (DataSourceRef, Threshold, ThresholdsMode,
                                                         VariableOption, VariableRefresh)
except ImportError as e:
    raise ImportError(f"{e.name} is missing: the dashboard is built with pip install 'pdserve[dashboards]'") from e

from pdserve.telemetry.thresholds import ALERT_ABOVE

UID = "pdserve-overview"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE_WINDOW = "$__rate_interval"  # Grafana's: at least four scrapes, whatever the zoom


def series(name: str, **labels: str) -> str:
    """`name` as the chosen routers export it, with `labels` matched exactly."""
    matchers = ['job=~"$job"', *(f'{key}="{value}"' for key, value in labels.items())]
    return f"{name}{{{','.join(matchers)}}}"


def per_worker(name: str) -> str:
    """One of the router's series per worker. A worker's own /metrics has series of the same
    names without the `worker` label: a scrape job that takes workers too counts none twice."""
    return series(name)[:-1] + ',worker!=""}'


def rate(name: str, by: str = "", **labels: str) -> str:
    summed = f"sum by ({by})" if by else "sum"
    return f"{summed} (rate({series(name, **labels)}[{RATE_WINDOW}]))"


def rate_per_worker(name: str) -> str:
    """What a per-worker count (a gauge that grows until the worker restarts) adds per second,
    summed over the workers."""
    return f"sum (rate({per_worker(name)}[{RATE_WINDOW}]))"


def increase(name: str, by: str = "") -> str:
    summed = f"sum by ({by})" if by else "sum"
    return f"{summed} (increase({series(name)}[{RATE_WINDOW}]))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', by=', '.join(filter(None, ('le', by))))})"


def percentiles(histogram: str, label: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{label} p{round(q * 100)}", quantile(q, histogram)) for q in (0.5, 0.95, 0.99))


@dataclass(frozen=True, slots=True)
class Graph:
    """One time-series panel: what it plots, in which unit, and how."""

    title: str
    unit: str  # Grafana's unit id: s, Bps (bytes/s), percentunit, reqps, short
    queries: tuple[tuple[str, str], ...]  # (legend, PromQL)
    description: str = ""
    stacked: bool = False
    bars: bool = False  # counts of events: one bar per interval
    alert_above: float | None = None  # drawn as a red line


PER_WORKER = "{{worker}} ({{role}})"

ROWS: dict[str, tuple[Graph, ...]] = {
    "Latency": (
        Graph("Time to first token", "s", percentiles("pdserve_ttft_seconds", "TTFT")),
        Graph("Time per output token", "s", (*percentiles("pdserve_tpot_seconds", "TPOT"),
                                             ("gap between chunks p99", quantile(0.99, "pdserve_itl_seconds")))),
        Graph("End to end", "s", percentiles("pdserve_e2e_seconds", "e2e")),
        Graph("Where the time goes (p95 by phase)", "s",
              (("{{phase}}", quantile(0.95, "pdserve_phase_seconds", by="phase")),), stacked=True,
              description="queue: on the workers; prefill: computing the prompt, wherever; transfer: the KV "
                          "hand-off not hidden behind prefill; decode: generating. Stacked p95s are an upper "
                          "bound of the p95 request, not its split."),
    ),
    "SLA": (
        Graph("SLA attainment (last 5 min)", "percentunit",
              (("{{metric}}", series("pdserve_sla_attainment")),),
              description="Share of the requests finished in the last 5 minutes within the TTFT target, the "
                          "TPOT target, and both (pdserve_sla_target_seconds)."),
        Graph("Goodput", "reqps", (("within both targets", rate("pdserve_sla_met_requests_total")),
                                   ("finished ok", rate("pdserve_requests_total", outcome="ok")))),
        Graph("Requests by outcome", "reqps", (("{{outcome}}", rate("pdserve_requests_total", by="outcome")),)),
        Graph("Error ratio", "percentunit",
              (("errors", f'{rate("pdserve_requests_total", outcome="error")} / {rate("pdserve_requests_total")}'),)),
        Graph("Tokens per second", "short", (("generated", rate("pdserve_generated_tokens_total")),
                                              ("prompt", rate("pdserve_prompt_tokens_total")))),
        Graph("Router queue", "short", (("requests held", series("pdserve_queue_requests")),
                                        ("requeued /s", rate("pdserve_requests_requeued_total"))),
              description="Requests the router holds because every worker's queue is full."),
    ),
    "Pools": (
        Graph("Workers by role", "short", (("{{role}}", series("pdserve_workers")),), stacked=True),
        Graph("Running per worker", "short", ((PER_WORKER, per_worker("pdserve_worker_running")),)),
        Graph("Waiting per worker", "short", (("{{worker}} queued", per_worker("pdserve_worker_waiting")),
                                              ("{{worker}} for KV", per_worker("pdserve_worker_waiting_for_kv")))),
        Graph("Decode waiting share", "percentunit",
              (("waiting", series("pdserve_decode_waiting_share")),),
              alert_above=ALERT_ABOVE["pdserve_decode_waiting_share"],
              description="Of the requests decode and colocated workers hold, the share queued or waiting for KV."),
        Graph("Pool utilization (mean KV use)", "percentunit",
              (("{{role}}", series("pdserve_pool_utilization")),
               ("prefill - decode spread", series("pdserve_pool_utilization_spread")))),
        Graph("Step time per worker", "ms", ((PER_WORKER, per_worker("pdserve_worker_step_latency_ewma_ms")),)),
    ),
    "KV": (
        Graph("KV use per worker", "percentunit", ((PER_WORKER, per_worker("pdserve_worker_kv_usage")),)),
        Graph("KV transfer bandwidth", "Bps", (("received by decode workers", rate("pdserve_kv_bytes_received")),),
              description="Bytes decode workers received, from their heartbeats (a worker that leaves "
                          "shows as a reset)."),
        Graph("KV transfer share of TTFT", "percentunit",
              (("transfer / TTFT", series("pdserve_kv_transfer_ttft_share")),),
              alert_above=ALERT_ABOVE["pdserve_kv_transfer_ttft_share"],
              description="Of remotely prefilled requests finished in the last 5 minutes, the transfer time "
                          "prefill compute did not hide over their time to first token."),
        Graph("Prompts landed or recomputed", "reqps",
              (("landed", rate_per_worker("pdserve_worker_kv_landed")),
               ("recomputed", rate_per_worker("pdserve_worker_kv_recomputed"))),
              description="Prompts whose KV arrived from a prefill worker, and those computed again on "
                          "their decode worker after a failed transfer."),
    ),
    "Changes": (
        Graph("Rebalances", "short", (("{{direction}}", increase("pdserve_rebalances_total", by="direction")),),
              bars=True, description="Workers the P:D controller moved to the other pool."),
        Graph("Restarts (workers registering again)", "short",
              (("{{role}}", increase("pdserve_worker_rejoins_total", by="role")),), bars=True),
        Graph("Workers dropped", "short", (("dropped", increase("pdserve_workers_dropped_total")),), bars=True,
              description="Lease lapsed, or a request failed on them."),
        Graph("Migrations by reason", "short", (("{{reason}}", increase("pdserve_migrations_total", by="reason")),),
              bars=True),
        Graph("Worker uptime", "s", ((PER_WORKER, per_worker("pdserve_worker_uptime_seconds")),),
              description="A drop to zero is a restart."),
    ),
    "Versions": (
        Graph("Canary share of new requests", "percentunit",
              (("canary", series("pdserve_rollout_canary_share")),),
              description="A rollout's current step (0 when none runs, after a promotion or a rollback)."),
        Graph("Rollouts ended", "short", (("{{outcome}}", increase("pdserve_rollouts_total", by="outcome")),),
              bars=True, description="promoted, rolled_back (by itself) or aborted (by hand)."),
        Graph("Shadow: greedy token agreement", "percentunit",
              (("agreement", series("pdserve_shadow_greedy_agreement")),),
              description="Of greedy requests' tokens, the share the shadow version produced alike from the "
                          "start, over the last comparisons."),
        Graph("Shadow: latency against the primary", "short",
              (("{{metric}} shadow / primary", series("pdserve_shadow_latency_ratio")),
               ("copies in flight", series("pdserve_shadow_in_flight"))),
              description="Median over the last comparisons; above 1 the shadow is slower."),
    ),
}


def timeseries(graph: Graph, panel_id: int) -> Timeseries:
    panel = (Timeseries().id(panel_id).title(graph.title).unit(graph.unit).datasource(DATASOURCE)
             .span(12).height(8))
    if graph.description:
        panel = panel.description(graph.description)
    if graph.unit == "percentunit":
        panel = panel.min(0).max(1)
    if graph.stacked:
        panel = panel.stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(30)
    if graph.bars:
        panel = panel.draw_style(GraphDrawStyle.BARS).fill_opacity(80)
    if graph.alert_above is not None:
        panel = (panel.thresholds(ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
                     [Threshold(None, "green"), Threshold(graph.alert_above, "red")]))
                 .thresholds_style(GraphThresholdsStyleConfig().mode(GraphThresholdsStyleMode.LINE)))
    for ref, (legend, expr) in zip("ABCDEFGH", graph.queries, strict=False):
        panel = panel.with_target(Dataquery().ref_id(ref).expr(expr).legend_format(legend))
    return panel


def build() -> Dashboard:
    board = (Dashboard("pdserve overview").uid(UID).tags(["pdserve"]).refresh("30s").time("now-1h", "now")
             .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
             .with_variable(QueryVariable("job").label("router job").datasource(DATASOURCE)
                            .query("label_values(pdserve_workers, job)").refresh(VariableRefresh.ON_DASHBOARD_LOAD)
                            .include_all(True).all_value(".*").current(VariableOption(True, "All", "$__all"))
                            .description("The scrape jobs of the routers to show (all by default)")))
    panel_id = 0
    for title, graphs in ROWS.items():
        panel_id += 1
        board = board.with_row(Row(title).id(panel_id))
        for graph in graphs:
            panel_id += 1
            board = board.with_panel(timeseries(graph, panel_id))
    return board


def to_json(board: Dashboard) -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(board.build()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve dashboard", description="Write the Grafana dashboard of a "
                                     "pdserve cluster (JSON, to import into Grafana).")
    parser.add_argument("--out", default=None, metavar="PATH", help="file to write (default: standard output)")
    args = parser.parse_args(argv)
    text = to_json(build())
    if args.out is None:
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
