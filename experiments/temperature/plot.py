"""The temperature sweep's plot and table, from its JSONL alone:

    python -m experiments.temperature.plot [experiments/temperature/results/results.jsonl]

Writes beside the JSONL ``temperature.png`` (per drafter against temperature: the acceptance
of the first draft position, alpha; accepted tokens per target pass; speedup over target-only
at the same setting; top-p 0.9 at T = 1 as open markers) and ``temperature.md``.
"""

from __future__ import annotations

import pathlib
import sys

from experiments.lib import toolkit
from experiments.lib import tree_report as report


def rows(records: list[dict]) -> list[dict]:
    out = []
    for temp, top_p, base, drafts in report.by_sampling(records):
        for r in drafts:
            out.append({"temperature": temp, "top_p": top_p, "drafter": r["drafter"], "setting": r["setting"],
                        "alpha": r["accepted_at"][0] / max(r["tested_at"][0], 1),
                        "acceptance_rate": r["accepted"] / max(r["proposed"], 1),
                        "tokens_per_pass": r["accepted_tokens_per_pass"], "tokens_per_s": r["tokens_per_s"],
                        "target_only_tokens_per_s": base["tokens_per_s"],
                        "speedup": r["tokens_per_s"] / base["tokens_per_s"],
                        "greedy_rows_matching": r.get("greedy_rows_matching"), "prompts": r["prompts"]})
    return out


def markdown(records: list[dict]) -> str:
    prov = next(r for r in records if r["kind"] == "generation")["provenance"]
    body = [[f"{r['temperature']:g}", f"{r['top_p']:g}", toolkit.drafter_label(r["drafter"]), r["setting"], toolkit.fmt(r["alpha"]),
             toolkit.fmt(r["acceptance_rate"]), toolkit.fmt(r["tokens_per_pass"]),
             toolkit.fmt(r["target_only_tokens_per_s"], 1), toolkit.fmt(r["tokens_per_s"], 1),
             toolkit.fmt(r["speedup"]) + "x",
             "–" if r["greedy_rows_matching"] is None else f"{r['greedy_rows_matching']}/{r['prompts']}"]
            for r in rows(records)]
    return "\n".join(["# Temperature sweep", "", *toolkit.provenance_lines(prov), "",
                      "alpha: acceptance at the first draft position; acceptance: accepted / proposed draft tokens; "
                      "speedup: decode tokens/s over target-only's at the same sampling setting (same prompts, "
                      "same per-request keys); greedy rows matching: prompts whose tokens equal target-only's.", "",
                      toolkit.table(["T", "top-p", "drafter", "setting", "alpha", "acceptance", "tokens/pass",
                                     "target-only tok/s", "tok/s", "speedup", "greedy rows matching"], body), ""])


def plot(path) -> list[pathlib.Path]:
    plt = toolkit.pyplot()

    path = pathlib.Path(path)
    records = toolkit.read_jsonl(path)
    prov = next(r for r in records if r["kind"] == "generation")["provenance"]
    rs = rows(records)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    for i, d in enumerate(dict.fromkeys(r["drafter"] for r in rs)):
        plain = sorted((r for r in rs if r["drafter"] == d and r["top_p"] == 1.0), key=lambda r: r["temperature"])
        nucleus = [r for r in rs if r["drafter"] == d and r["top_p"] != 1.0]
        for ax, key in zip(axes, ("alpha", "tokens_per_pass", "speedup")):
            ax.plot([r["temperature"] for r in plain], [r[key] for r in plain], "o-", color=f"C{i}",
                    label=f"{toolkit.drafter_label(d)} ({plain[0]['setting'] if plain else ''})")
            if nucleus:
                ax.plot([r["temperature"] for r in nucleus], [r[key] for r in nucleus], "s", mfc="none", ms=9,
                        color=f"C{i}", label=f"{toolkit.drafter_label(d)}, top-p {nucleus[0]['top_p']:g}")
    model = toolkit.model_label(prov.get("model"))
    for ax, (yl, t) in zip(axes, (("alpha (first-position acceptance)", "Acceptance"),
                                  ("accepted tokens per target pass", "Tokens per pass"),
                                  ("speedup (x target-only tokens/s)", "Speedup"))):
        ax.set_xlabel("temperature")
        ax.set_ylabel(yl)
        ax.set_title(t, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[2].axhline(1.0, color="gray", lw=0.8)
    fig.suptitle(f"Temperature sweep: {model} target, batch 1, held-out Spec-Bench\n{toolkit.run_caption(prov)}",
                 fontsize=10)
    out = toolkit.save_figure(fig, path.with_name("temperature.png"))
    md = path.with_name("temperature.md")
    md.write_text(markdown(records))
    return [out, md]


if __name__ == "__main__":
    for p in plot(sys.argv[1] if len(sys.argv) > 1 else "experiments/temperature/results/results.jsonl"):
        print(p)
