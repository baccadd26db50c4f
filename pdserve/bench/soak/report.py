"""The soak's report: the summary line, the action x outcome table, and the plots (memory over
time; outcomes per second)."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.soak.actions import CATEGORY

# Outcome classes of the outcomes-per-second plot, in stacking order.
CLASSES = ("answered", "refused (4xx, as expected)", "429", "connection-level", "failure")
CONNECTION_LEVEL = {"closed", "abandoned", "completed"}


def outcome_class(label: str, ok: bool) -> str:
    if not ok:
        return "failure"
    if label == "429":
        return "429"
    if label in CONNECTION_LEVEL:
        return "connection-level"
    return "answered" if label.startswith("2") else "refused (4xx, as expected)"


def _label_order(label: str) -> tuple[int, str]:
    return (0, label) if label[:3].isdigit() else (1, label)


def table(rows: dict[str, dict]) -> str:
    """Markdown: one row per action, a column per outcome; failing counts marked ✗."""
    labels = sorted({label for row in rows.values() for label in row["outcomes"]}, key=_label_order)
    lines = ["| action | opened | " + " | ".join(labels) + " | failures | unaccounted |",
             "|" + " --- |" * (len(labels) + 4)]
    order = sorted(rows, key=lambda a: (("valid", "malformed", "abusive").index(CATEGORY.get(a, "abusive")), a))
    for action in order:
        row = rows[action]
        cells = []
        for label in labels:
            count = row["outcomes"].get(label, 0)
            cells.append("" if not count else f"{count} ✗" if label in row["failed"] else str(count))
        lines.append(f"| {action} | {row['opened']} | " + " | ".join(cells) + f" | {row['failures']} "
                     f"| {row['unaccounted']} |")
    totals = {label: sum(r["outcomes"].get(label, 0) for r in rows.values()) for label in labels}
    lines.append(f"| **all** | {sum(r['opened'] for r in rows.values())} | "
                 + " | ".join(str(totals[label]) for label in labels)
                 + f" | {sum(r['failures'] for r in rows.values())} | {sum(r['unaccounted'] for r in rows.values())} |")
    return "\n".join(lines)


def summary_line(result: dict) -> str:
    s, mem, audit = result["settings"], result["memory"], result["audit"]
    opened = sum(r["opened"] for r in result["actions"].values())
    unaccounted = sum(r["unaccounted"] for r in result["actions"].values())
    failures = sum(r["failures"] for r in result["actions"].values())
    failed = [c["name"] for c in audit["checks"] if not c["passed"]]
    verdict = "PASS" if audit["passed"] else "FAIL (" + "; ".join(failed) + ")"
    growth = mem["peak_mib"] - mem["baseline_mib"]
    return (f"soak {s['model']}: {verdict}: {result['soak_seconds']:.0f} s, {s['concurrency']} clients, seed "
            f"{s['seed']}: {opened} requests, {failures} failures, {unaccounted} unaccounted; memory (without shared "
            f"KV pools) baseline {mem['baseline_mib']:.0f} MiB, peak {mem['peak_mib']:.0f} MiB ({growth:+.0f}, "
            f"bound {mem['bound_mib']:g})")


def details(result: dict) -> str:
    """The audit's checks, each burst, and the server log's tally, one line each."""
    lines = [f"- {'ok  ' if c['passed'] else 'FAIL'} {c['name']}: {c['detail']}" for c in result["audit"]["checks"]]
    for b in result["bursts"]:
        lines.append(f"- burst at {b['at_s']:g} s: {b['sent']} requests at once, done in {b['seconds']:g} s: "
                     f"{b['outcomes']}")
    mem, log = result["memory"], result["server_log"]
    lines.append(f"- memory with the shared KV pools: baseline {mem['total_pss_baseline_mib']:.0f} MiB, peak "
                 f"{mem['total_pss_peak_mib']:.0f} MiB (shared memory at most {mem['shmem_peak_mib']:.0f} MiB)")
    lines.append(f"- server log: {log['errors']} error lines, {log['warnings']} warnings ({log['path']})")
    return "\n".join(lines)


def outcomes_over_time(events: list[tuple[float, str, bool]]) -> dict:
    """Outcomes per class in time bins (at most ~150 of them) from the traffic's start."""
    end = max((t for t, _, _ in events), default=1.0)
    width = next((w for w in (1, 2, 5, 10, 15, 30, 60) if end / w <= 150), 120)
    counts = {c: [0] * (int(end // width) + 1) for c in CLASSES}
    for t, label, ok in events:
        counts[outcome_class(label, ok)][int(t // width)] += 1
    return {"bin_s": width, "counts": counts}


def plots(result: dict, plot_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    mem = result["memory"]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    times = [m["t_s"] for m in mem["samples"]]
    ax.plot(times, [m["rest_mib"] for m in mem["samples"]], color="black", lw=2,
            label="cluster without shared memory (bounded)")
    ax.plot(times, [m["shmem_mib"] for m in mem["samples"]], color="black", ls="-.", lw=1,
            label="shared memory (KV pools)")
    for name in mem["samples"][0]["by_process"] if mem["samples"] else ():
        ax.plot(times, [m["by_process"].get(name, float("nan")) for m in mem["samples"]], lw=1,
                label=f"{name} (PSS)")
    ax.axhline(mem["baseline_mib"], color="gray", ls="--", lw=1, label="baseline (without shared memory)")
    ax.axhline(mem["baseline_mib"] + mem["bound_mib"], color="red", ls=":", lw=1, label="baseline + bound")
    ax.axvspan(0, result["soak_seconds"], color="tab:blue", alpha=0.06, label="traffic")
    ax.set(xlabel="seconds since the traffic started", ylabel="MiB (proportional set size)",
           title=f"{result['settings']['model']}: cluster memory during the soak")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3)
    fig.tight_layout()
    written.append(plot_dir / "soak_memory.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    over_time = result["outcomes_over_time"]
    width = over_time["bin_s"]
    counts = {c: [n / width for n in over_time["counts"][c]] for c in CLASSES}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = [i * width for i in range(len(counts[CLASSES[0]]))]
    colors = {"answered": "tab:green", "refused (4xx, as expected)": "tab:blue", "429": "tab:orange",
              "connection-level": "tab:gray", "failure": "tab:red"}
    ax.stackplot(xs, *[counts[c] for c in CLASSES], labels=CLASSES, colors=[colors[c] for c in CLASSES], step="post")
    ax.axvline(result["settings"]["duration"], color="black", ls=":", lw=1, label="end of new actions")
    ax.set_yscale("symlog", linthresh=10)  # a burst's hundreds beside the steady few a second
    ax.set(xlabel="seconds since the traffic started", ylabel=f"outcomes per second ({width:g} s bins, symlog)",
           title=f"{result['settings']['model']}: outcomes over time")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    written.append(plot_dir / "soak_outcomes.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
