"""Plot of the distillation study, read from its JSONL only:

    python -m experiments.distill_study.plot [experiments/distill_study/results/results.jsonl]

Writes ``distill_study.png`` beside the JSONL: held-out alpha (left) and greedy agreement
(right) after distillation, per divergence (groups) and data source (bars: mean over seeds;
dots: each seed), the starting draft's value as a dashed line.
"""

from __future__ import annotations

import pathlib
import statistics
import sys

from experiments.lib import toolkit
from experiments.distill_study.report import DIV_LABELS, cells


def plot(path) -> list[pathlib.Path]:
    plt = toolkit.pyplot()
    path = pathlib.Path(path)
    records = toolkit.read_jsonl(path)
    setup = next(r for r in records if r["kind"] == "setup")
    start = next(r for r in records if r["kind"] == "start")
    divs = setup["divergences"]
    sources = list(dict.fromkeys(r["source"] for r in records if r["kind"] == "run"))
    width = 0.8 / max(len(sources), 1)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, start_value, label in ((axes[0], "alpha_after", start["alpha"], "held-out alpha (temperature 1)"),
                                        (axes[1], "agreement_after", start["agreement"], "held-out greedy agreement")):
        vals = cells(records, key)
        for j, s in enumerate(sources):
            xs = [i + (j - (len(sources) - 1) / 2) * width for i in range(len(divs))]
            means = [statistics.fmean(vals[(d, s)]) if vals.get((d, s)) else float("nan") for d in divs]
            ax.bar(xs, means, width * 0.9, color=f"C{j}", alpha=0.75, label=f"{s} data (mean of seeds)")
            for x, d in zip(xs, divs):
                v = vals.get((d, s), [])
                ax.plot([x] * len(v), v, "k.", ms=5, label="each seed" if (j == 0 and d == divs[0]) else None)
        ax.axhline(start_value, color="gray", ls="--", lw=1, label=f"start ({start_value:.3f})")
        ax.set_xticks(range(len(divs)), [DIV_LABELS.get(d, d) for d in divs])
        ax.set_xlabel("divergence")
        ax.set_ylabel(label + " (fraction)")
        lo = min([start_value] + [min(v) for v in vals.values()])
        hi = max([start_value] + [max(v) for v in vals.values()])
        ax.set_ylim(max(0.0, lo - 0.2 * (hi - lo + 1e-3)), hi + 0.4 * (hi - lo + 1e-3))   # room for the legend
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    prov = setup["provenance"]
    fig.suptitle(f"Distillation study: {setup['budget_tokens']} loss tokens per run, {len(setup['seeds'])} seeds, "
                 f"{toolkit.model_label(prov.get('model'))} target\n{toolkit.run_caption(prov)}", fontsize=10)
    return [toolkit.save_figure(fig, path.with_name("distill_study.png"))]


if __name__ == "__main__":
    for p in plot(sys.argv[1] if len(sys.argv) > 1 else "experiments/distill_study/results/results.jsonl"):
        print(p)
