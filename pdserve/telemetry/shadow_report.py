"""`pdserve shadow-report`: the router's comparison of its shadow traffic (GET /admin/shadow), as
a table: requests mirrored, skipped and failed, greedy token agreement, and each latency's median
on the primary and the shadow side with their ratio. The admin key is read from
`--admin-key-file` or the PDSERVE_ADMIN_KEY environment variable, never the command line."""

from __future__ import annotations

import argparse
import json
import sys

import httpx

from pdserve.credentials import ADMIN_KEY_ENV, add_secret_args, read_secret

DEFAULT_ROUTER = "http://127.0.0.1:8000"
COUNTS = ("mirrored", "compared", "skipped_busy", "skipped_no_worker", "shadow_failed", "primary_failed",
          "greedy_compared", "greedy_identical")


def render(report: dict) -> str:
    """The report as text."""
    agreement = report.get("greedy_agreement_mean")
    lines = [f"shadow version {report['version']}: {report['share']:.0%} of requests, at most "
             f"{report['max_concurrency']} at once ({report['in_flight']} now), for {report['running_s']:.0f} s"
             + (f"; the leading router's copies, one of {report['routers']} routers" if report.get("routers", 1) > 1
                else ""),
             "  " + "  ".join(f"{key} {report[key]}" for key in COUNTS),
             f"  greedy token agreement (from the start): "
             f"{'n/a' if agreement is None else f'{agreement:.1%}'} over the last {report['window']} comparisons",
             f"  {'median':<12}{'primary':>12}{'shadow':>12}{'ratio':>9}"]
    for name, medians in report["latency_medians"].items():
        if medians:
            ratio = medians["ratio"]
            lines.append(f"  {name:<12}{medians['primary'] * 1e3:>10.1f}ms{medians['shadow'] * 1e3:>10.1f}ms"
                         f"{'n/a' if ratio is None else f'{ratio:.2f}x':>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve shadow-report", description="The router's comparison of the "
                                     "shadow traffic it sends (started with POST /admin/shadow).")
    parser.add_argument("--router", default=DEFAULT_ROUTER, metavar="URL", help=f"default: {DEFAULT_ROUTER}")
    parser.add_argument("--json", action="store_true", help="print the report as the router sent it")
    add_secret_args(parser, "admin-key", ADMIN_KEY_ENV, "the router's admin key")
    args = parser.parse_args(argv)
    key = read_secret(args.admin_key_file, ADMIN_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(args.router.rstrip("/") + "/admin/shadow", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        print(f"pdserve shadow-report: the router at {args.router} did not answer: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {r.status_code}"
        print(f"pdserve shadow-report: {message}", file=sys.stderr)
        return 1
    print(json.dumps(r.json(), indent=2) if args.json else render(r.json()))
    return 0
