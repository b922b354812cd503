"""Plots of the load study, read from its JSONL only:

    python -m experiments.load_study.plot [experiments/load_study/results/results.jsonl]

Writes ``load_study.png`` beside the JSONL: one row per slot count; against the offered load
(fraction of target-only's saturated rate; the last point every request at once), per mode:
throughput relative to target-only at the same workload, median inter-token latency and median
time to first token. Poisson arrivals solid, bursty dashed; live-scheduler runs as stars, over HTTP as plus signs.
"""

from __future__ import annotations

import pathlib
import sys

from experiments.lib import toolkit


def plot(path) -> list[pathlib.Path]:
    plt = toolkit.pyplot()
    path = pathlib.Path(path)
    records = toolkit.read_jsonl(path)
    setup = next(r for r in records if r["kind"] == "setup")
    loads = [r for r in records if r["kind"] == "load"]
    live = [r for r in records if r["kind"] == "live"]
    prov = setup["provenance"]
    modes = list(setup["modes"])
    xs = sorted(setup["loads"])
    x_all = (xs[-1] if xs else 0) + 0.2            # where 'all at once' is drawn
    base = {(r["slots"], r["arrivals"], r["load"]): r for r in loads if r["mode"] == "target-only"}
    slots_list = setup["slots"]
    fig, axes = plt.subplots(len(slots_list), 3, figsize=(13, 3.4 * len(slots_list)), squeeze=False)
    for row, slots in enumerate(slots_list):
        ax_rel, ax_itl, ax_ttft = axes[row]
        for i, mode in enumerate(modes):
            color = f"C{i}"
            for kind, style in (("poisson", "o-"), ("bursty", "s--")):
                rs = sorted((r for r in loads if r["slots"] == slots and r["mode"] == mode and r["arrivals"] == kind),
                            key=lambda r: r["load"])
                sat = [r for r in loads if r["slots"] == slots and r["mode"] == mode and r["arrivals"] == "all at once"]
                rs = rs + sat
                x = [r["load"] if r["arrivals"] != "all at once" else x_all for r in rs]
                label = f"{mode} ({kind})"
                ax_rel.plot(x, [r["throughput_tok_s"] / base[(slots, r["arrivals"], r["load"])]["throughput_tok_s"]
                                for r in rs], style, color=color, label=label, ms=4)
                ax_itl.plot(x, [1e3 * (r["inter_token_s_p50"] or float("nan")) for r in rs], style, color=color,
                            label=label, ms=4)
                ax_ttft.plot(x, [r["ttft_s_p50"] for r in rs], style, color=color, label=label, ms=4)
            for r in (r for r in live if r["slots"] == slots and r["mode"] == mode):
                http = r.get("transport") == "http"
                marker = "P" if http else "*"
                ax_itl.plot([r["load"]], [1e3 * r["inter_token_s_p50"]], marker, color=color, ms=9 if http else 11,
                            label=f"{mode} ({'HTTP' if http else 'live'})")
                b = base[(slots, r["arrivals"], r["load"])]
                ax_rel.plot([r["load"]], [r["throughput_tok_s"] / b["throughput_tok_s"]], marker, color=color,
                            ms=9 if http else 11)
        ax_rel.axhline(1.0, color="gray", lw=0.8)
        ax_rel.axhline(0.98, color="gray", lw=0.6, ls=":")
        titles = [("throughput / target-only's", "ratio"), ("inter-token latency p50", "ms"),
                  ("time to first token p50", "s")]
        for ax, (t, yl) in zip((ax_rel, ax_itl, ax_ttft), titles):
            ax.set_xticks(xs + [x_all], [f"{x:g}" for x in xs] + ["all"])
            ax.set_xlabel("offered load (fraction of target-only's saturated rate)")
            ax.set_ylabel(yl)
            ax.set_title(f"{slots} slots: {t}", fontsize=9)
            ax.grid(alpha=0.3)
        ax_ttft.set_yscale("log")
        if row == 0:
            ax_itl.legend(fontsize=6)
    model = toolkit.model_label(prov.get("model"))
    fig.suptitle(f"Load study, {model} target: Poisson solid, bursty dashed, live scheduler stars, over HTTP plus signs\n"
                 f"{toolkit.run_caption(prov)}", fontsize=10)
    fig.tight_layout()
    return [toolkit.save_figure(fig, path.with_name("load_study.png"))]


if __name__ == "__main__":
    for p in plot(sys.argv[1] if len(sys.argv) > 1 else "experiments/load_study/results/results.jsonl"):
        print(p)
