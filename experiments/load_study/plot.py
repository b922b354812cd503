"""Plots of the load study, read from its JSONL only:

    python -m experiments.load_study.plot [experiments/load_study/results/results.jsonl]

Writes ``load_study.png`` beside the JSONL: against the arrival rate (requests/s; 'all at
once' = saturated), per mode: throughput (generated tokens/s), time to first token (median,
with the 90th percentile dashed), median inter-token latency, and throughput relative to
target-only at the same rate (for adaptive modes also the share of gamma = 0 rounds).
"""

from __future__ import annotations

import pathlib
import sys

from experiments.lib import toolkit
from experiments.load_study.report import rate_label


def plot(path) -> list[pathlib.Path]:
    plt = toolkit.pyplot()

    path = pathlib.Path(path)
    records = toolkit.read_jsonl(path)
    setup = next(r for r in records if r["kind"] == "setup")
    loads = [r for r in records if r["kind"] == "load"]
    cal = {r["mode"]: r for r in records if r["kind"] == "calibration"}
    prov = setup["provenance"]
    rates = list(dict.fromkeys(r["rate"] for r in loads))
    order = sorted(rates, key=lambda x: float("inf") if x == 0 else x)
    xs = {rate: i for i, rate in enumerate(order)}
    modes = list(dict.fromkeys(r["mode"] for r in loads))
    base = {r["rate"]: r for r in loads if r["mode"] == "target-only"}
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    (ax_tp, ax_ttft), (ax_itl, ax_rel) = axes
    for i, mode in enumerate(modes):
        rs = sorted((r for r in loads if r["mode"] == mode), key=lambda r: xs[r["rate"]])
        x = [xs[r["rate"]] for r in rs]
        color = f"C{i}"
        ax_tp.plot(x, [r["throughput_tok_s"] for r in rs], "o-", color=color, label=mode)
        ax_ttft.plot(x, [r["ttft_s_p50"] for r in rs], "o-", color=color, label=f"{mode} (p50)")
        ax_ttft.plot(x, [r["ttft_s_p90"] for r in rs], "--", color=color, alpha=0.6)
        ax_itl.plot(x, [1e3 * (r["inter_token_s_p50"] or float("nan")) for r in rs], "o-", color=color, label=mode)
        if base:
            ax_rel.plot(x, [r["throughput_tok_s"] / base[r["rate"]]["throughput_tok_s"] for r in rs], "o-",
                        color=color, label=mode)
        if mode in cal:
            g0 = cal[mode]["gammas"].index(0) if 0 in cal[mode]["gammas"] else None
            if g0 is not None:
                share = [r["rounds_per_gamma"][g0] / max(sum(r["rounds_per_gamma"]), 1) for r in rs]
                ax_rel.plot(x, share, "x:", color=color, label=f"{mode}: share of gamma=0 rounds")
    ax_rel.axhline(1.0, color="gray", lw=0.8)
    labels = [("Throughput", "generated tokens / s"), ("Time to first token", "seconds (solid p50, dashed p90)"),
              ("Inter-token latency (median request)", "ms per token"),
              ("Throughput vs target-only at the same rate", "ratio (x: share of gamma=0 rounds)")]
    for ax, (t, yl) in zip(axes.flat, labels):
        ax.set_xticks(range(len(order)), [rate_label(r) for r in order])
        ax.set_xlabel("arrival rate (requests / s)")
        ax.set_ylabel(yl)
        ax.set_title(t, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    model = toolkit.model_label(prov.get("model"))
    fig.suptitle(f"Load study: {setup['slots']} slots, {setup['requests']} requests, {model} target\n"
                 f"{toolkit.run_caption(prov)}", fontsize=10)
    return [toolkit.save_figure(fig, path.with_name("load_study.png"))]


if __name__ == "__main__":
    for p in plot(sys.argv[1] if len(sys.argv) > 1 else "experiments/load_study/results/results.jsonl"):
        print(p)
