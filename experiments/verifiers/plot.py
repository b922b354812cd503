"""The verifier comparison's plot and table, from its JSONL alone:

    python -m experiments.verifiers.plot [experiments/verifiers/results/results.jsonl]

Writes ``verifiers.png`` (accepted tokens per target pass of each drafter's chain and tree under
each verifier, grouped bars; the same drafts, prompts and keys) and ``verifiers.md`` beside it.
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
            setting, _, verifier = r["setting"].partition("@")
            out.append({"temperature": temp, "top_p": top_p, "drafter": r["drafter"], "draft": setting,
                        "verifier": verifier or "token", "tokens_per_pass": r["accepted_tokens_per_pass"],
                        "accepted_per_round": r["accepted"] / max(r["target_passes"], 1),
                        "acceptance_per_position": [a / t if t else None for a, t in zip(r["accepted_at"], r["tested_at"])],
                        "speedup": r["tokens_per_s"] / base["tokens_per_s"], "new_tokens": r["new_tokens"],
                        "target_passes": r["target_passes"]})
    return out


def markdown(records: list[dict]) -> str:
    prov = next(r for r in records if r["kind"] == "generation")["provenance"]
    body = [[f"{r['temperature']:g}", toolkit.drafter_label(r["drafter"]), r["draft"], r["verifier"], toolkit.fmt(r["tokens_per_pass"]),
             toolkit.fmt(r["accepted_per_round"]),
             ", ".join("–" if a is None else f"{a:.2f}" for a in r["acceptance_per_position"]),
             str(r["target_passes"]), toolkit.fmt(r["speedup"]) + "x"] for r in rows(records)]
    return "\n".join(["# Verifiers: token vs block (chains), recursive rejection vs traversal (trees)", "",
                      *toolkit.provenance_lines(prov), "",
                      "Accepted tokens per target pass (committed tokens / passes, the bonus or correction token "
                      "included); accepted per round: draft tokens kept per pass; acceptance per position along the "
                      "accepted path; speedup: decode tokens/s over target-only's in the same run. Every verifier "
                      "sees the same drafter, prompts and per-request keys; all four are exact (tests/"
                      "test_block_verify.py, tests/test_tree_verify.py), so only the number of tokens kept per pass "
                      "may differ.", "",
                      toolkit.table(["T", "drafter", "draft", "verifier", "tokens/pass", "accepted/round",
                                     "acceptance per position", "target passes", "speedup"], body), ""])


def plot(path) -> list[pathlib.Path]:
    plt = toolkit.pyplot()

    path = pathlib.Path(path)
    records = toolkit.read_jsonl(path)
    prov = next(r for r in records if r["kind"] == "generation")["provenance"]
    rs = rows(records)
    groups = list(dict.fromkeys((r["drafter"], r["draft"]) for r in rs))
    verifiers = list(dict.fromkeys(r["verifier"] for r in rs))
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(groups)), 4.8))
    width = 0.8 / max(len(verifiers), 1)
    for i, v in enumerate(verifiers):
        xs, ys = [], []
        for j, g in enumerate(groups):
            r = next((r for r in rs if (r["drafter"], r["draft"]) == g and r["verifier"] == v), None)
            if r is not None:
                xs.append(j + (i - (len(verifiers) - 1) / 2) * width)
                ys.append(r["tokens_per_pass"])
        bars = ax.bar(xs, ys, width, label=v, color=f"C{i}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(groups)), [f"{toolkit.drafter_label(d)}\n{s}" for d, s in groups], fontsize=8)
    ax.set_ylabel("accepted tokens per target pass")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, title="verifier")
    model = toolkit.model_label(prov.get("model"))
    temps = sorted({r["temperature"] for r in rs})
    ax.set_title(f"Verifiers on the same drafts, T = {', '.join(f'{t:g}' for t in temps)}: {model} target, batch 1\n"
                 f"{toolkit.run_caption(prov)}", fontsize=9)
    out = toolkit.save_figure(fig, path.with_name("verifiers.png"))
    md = path.with_name("verifiers.md")
    md.write_text(markdown(records))
    return [out, md]


if __name__ == "__main__":
    for p in plot(sys.argv[1] if len(sys.argv) > 1 else "experiments/verifiers/results/results.jsonl"):
        print(p)
