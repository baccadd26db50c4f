"""A PNG of a simulated trace: the load, the controller's pools, and attainment per window."""

from __future__ import annotations

from pathlib import Path

from pdserve.workload.plots import pyplot, save_figure


def trace_sim_plot(result: dict, out_dir: Path) -> Path:
    plt = pyplot()
    fig, (load, pools, sla) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    scale = result["settings"]["time_scale"] / 3600  # simulated s -> trace hours
    windows = result["windows"]
    hours = [w["start_s"] * scale for w in windows] + [windows[-1]["end_s"] * scale]
    step = lambda values: values + values[-1:]  # noqa: E731 - one value per window, held to its end

    load.step(hours, step([w["qps"] for w in windows]), where="post", label="requests/s")
    isl = load.twinx()
    isl.step(hours, step([w["isl_mean"] for w in windows]), where="post", color="gray", linestyle=":",
             label="mean prompt tokens")
    isl.set(ylabel="mean prompt tokens")
    isl.set_ylim(bottom=0)
    load.set(ylabel="load (req/s)")
    load.legend(loc="upper left", fontsize=8)
    isl.legend(loc="upper right", fontsize=8)

    splits = result["controller"]["splits"]
    t = [s["at_s"] * scale for s in splits] + [hours[-1]]
    pools.step(t, step([s["prefill"] for s in splits]), where="post", label="prefill (controller)")
    pools.step(t, step([s["decode"] for s in splits]), where="post", label="decode (controller)")
    workers = result["settings"]["workers"]
    pools.step(hours, step([workers * w["needs_prefill"] / (w["needs_prefill"] + w["needs_decode"]) for w in windows]),
               where="post", color="gray", linestyle=":", label="prefill, rate-matched (closed-form estimate)")
    best = result["best_static"]["start"]
    pools.axhline(int(best.split("P")[0]), color="black", linestyle="--", linewidth=1,
                  label=f"prefill, best static ({best})")
    for m in result["controller"]["moves"]:
        pools.axvline(m["at_s"] * scale, color="gray", alpha=0.3, linewidth=0.8)
    pools.set(ylabel="workers serving")
    pools.legend(fontsize=8)

    for key, label in (("controller", "controller"), ("best_static", f"best static {best}"),
                       ("one_to_one", "static 1:1")):
        sla.step(hours, step([w["sla_attainment_pct"] or 0.0 for w in result[key]["windows"]]), where="post",
                 label=label)
    sla.set(xlabel="hours into the trace", ylabel="SLA attainment %")
    sla.legend(fontsize=8)
    for ax in (load, pools, sla):
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    return save_figure(plt, fig, "P:D controller over the trace", out_dir / "simulate_trace.png")
