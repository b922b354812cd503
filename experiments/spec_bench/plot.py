"""The Spec-Bench table's plot, from the bench's JSONL alone:

    python -m experiments.spec_bench.plot [experiments/spec_bench/results/results.jsonl]

Writes ``spec_bench.png`` beside it: per Spec-Bench category (and over all prompts), each
drafter's speedup over target-only decoding (top) and mean accepted tokens per target pass
(bottom), as grouped bars.
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
    sums = [r for r in records if r["kind"] == "summary" and r["method"] != "target_only"]
    methods = list(dict.fromkeys(r["method"] for r in sums))
    cats = list(dict.fromkeys(r["category"] for r in sums if r["category"] != "all")) + ["all"]
    by = {(r["method"], r["category"]): r for r in sums}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(min(16, max(8, 0.35 * len(cats) * max(len(methods), 1) + 3)), 8))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(cats))]
        name = toolkit.drafter_label(m)
        ax1.bar(xs, [by.get((m, k), {}).get("speedup") or 0 for k in cats], width, label=name, color=f"C{i}")
        ax2.bar(xs, [by.get((m, k), {}).get("mean_accepted_tokens") or 0 for k in cats], width, label=name,
                color=f"C{i}")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax2.axhline(1.0, color="gray", lw=0.8)
    c, machine = setup["config"], setup["machine"]
    for ax, yl in ((ax1, "speedup (x target-only decode tokens/s)"), (ax2, "mean accepted tokens per target pass")):
        ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    model = toolkit.model_label(c.get("target"))
    gamma = f"adaptive {tuple(c['adaptive_gammas'])}" if c["adaptive_gamma"] else f"gamma {c['gamma']}"
    ax1.set_title(f"Spec-Bench (held-out, {setup['prompts']} prompts): {model} target, batch 1, T = "
                  f"{c['temperature']:g}, {gamma}\n{machine.get('cpu')} ({machine.get('cores')} cores), commit "
                  f"{str(setup.get('commit'))[:8]}", fontsize=9)
    return [toolkit.save_figure(fig, path.with_name("spec_bench.png"))]


if __name__ == "__main__":
    for p in plot(sys.argv[1] if len(sys.argv) > 1 else "experiments/spec_bench/results/results.jsonl"):
        print(p)
