"""Plots of the draft-head benchmark, read from its JSONL only (bench_trees format):

    python -m experiments.heads.plot [experiments/heads/results/results.jsonl]

Writes beside the JSONL, one figure per temperature:
* ``tokens_per_pass_T{t}.png``: accepted tokens per target pass against gamma for every drafter's
  chains (measured points) with the i.i.d. theory (1 - alpha^(gamma+1)) / (1 - alpha) of
  Leviathan et al. (2023) at that drafter's measured first-proposal acceptance (lines); trees
  as points at their node count.
* ``speedup_T{t}.png``: measured tokens/s over target-only's against the cost model's prediction
  (`specjax.analysis.RoundCost` from the measured draft cost and N-token pass costs, alpha as
  above), with the y = x line: points below it lost more than the model's i.i.d. acceptance
  and measured costs account for.
"""

from __future__ import annotations

import pathlib
import sys

from experiments.lib import toolkit
from specjax import analysis


def _name(d: str) -> str:
    return d.split("/")[-1] + " head" if d.startswith("head:") else d


def _title(prov: dict, what: str, temp: float) -> str:
    m = prov.get("machine", {})
    return (f"{what}, T = {temp:g}\nSmolLM2-135M-Instruct target, {m.get('cpu_model', '?')} "
            f"({m.get('cpus_usable', '?')} CPUs), commit {prov.get('git_commit', '?')[:8]}")


def _finish(fig, ax, out: pathlib.Path, xlabel: str, ylabel: str, title: str) -> pathlib.Path:
    import matplotlib.pyplot as plt
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot(path) -> list[pathlib.Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    path = pathlib.Path(path)
    records = toolkit.read_jsonl(path)
    prov = records[0]["provenance"]
    gens = [r for r in records if r["kind"] == "generation"]
    costs = {r["n"]: r["median_s"] for r in records if r["kind"] == "node_cost"}
    written = []
    for temp in sorted({r["temperature"] for r in gens}):
        rows = [r for r in gens if r["temperature"] == temp and r["drafter"] != "none"]
        base = next(r for r in gens if r["temperature"] == temp and r["drafter"] == "none")
        drafters = sorted({r["drafter"] for r in rows})
        fig, ax = plt.subplots(figsize=(7, 4.5))
        fig2, ax2 = plt.subplots(figsize=(5.5, 5))
        lo, lim = float("inf"), 0.0
        for i, d in enumerate(drafters):
            color = f"C{i}"
            chains = sorted((r for r in rows if r["drafter"] == d and r["setting"].startswith("chain:")),
                            key=lambda r: int(r["setting"].split(":")[1]))
            trees = [r for r in rows if r["drafter"] == d and not r["setting"].startswith("chain:")]
            if chains:
                first = chains[0]
                alpha = min(first["accepted_at"][0] / max(first["tested_at"][0], 1), 1 - 1e-9)
                gs = [int(r["setting"].split(":")[1]) for r in chains]
                ax.plot(gs, [r["accepted_tokens_per_pass"] for r in chains], "o", color=color,
                        label=f"{_name(d)} measured (alpha = {alpha:.2f})")
                grid = range(1, max(gs) + 1)
                ax.plot(list(grid), [analysis.expected_tokens_per_round(alpha, g) for g in grid], "-", color=color,
                        alpha=0.6, label=f"{_name(d)} theory at alpha = {alpha:.2f}")
                for r, g in zip(chains, gs):
                    if 1 in costs and g + 1 in costs:
                        round_s = r["seconds"] / max(r["target_passes"], 1)
                        draft_s = max(round_s - costs[g + 1], 0.0) / g
                        rc = analysis.RoundCost(draft_s=draft_s, verify_s={1: costs[1], g + 1: costs[g + 1]})
                        pred = rc.predicted_speedup(alpha, g, costs[1])
                        meas = r["tokens_per_s"] / base["tokens_per_s"]
                        ax2.plot([pred], [meas], "o", color=color)
                        ax2.annotate(f"{_name(d)} g{g}", (pred, meas), fontsize=7, xytext=(3, 3),
                                     textcoords="offset points")
                        lo, lim = min(lo, pred, meas), max(lim, pred, meas)
            for r in trees:
                ax.plot([r["tokens_scored_per_pass"] - 1], [r["accepted_tokens_per_pass"]], "^", color=color)
                ax.annotate(r["setting"], (r["tokens_scored_per_pass"] - 1, r["accepted_tokens_per_pass"]),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        written.append(_finish(fig, ax, path.parent / f"tokens_per_pass_T{temp:g}.png",
                               "draft tokens per round (gamma; trees: nodes, triangles)",
                               "accepted tokens per target pass",
                               _title(prov, "Accepted tokens per pass: measured vs i.i.d. theory", temp)))
        lo, hi = max(lo * 0.9, 0.0), max(lim * 1.1, 1.1)
        ax2.plot([lo, hi], [lo, hi], "k--", lw=1, label="measured = predicted")
        ax2.axhline(1.0, color="grey", lw=0.8)
        ax2.set_xlim(lo, hi)
        ax2.set_ylim(lo, hi)
        written.append(_finish(fig2, ax2, path.parent / f"speedup_T{temp:g}.png",
                               "cost model's predicted speedup (x target-only)",
                               "measured speedup (x target-only tokens/s)",
                               _title(prov, "Speedup: measured vs predicted", temp)))
    return written


if __name__ == "__main__":
    for p in plot(sys.argv[1] if len(sys.argv) > 1 else "experiments/heads/results/results.jsonl"):
        print(p)
