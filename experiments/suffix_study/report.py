"""The suffix study's table and plot, from its JSONL only:

    python -m experiments.suffix_study.report [experiments/suffix_study/results/results.jsonl]

Writes ``results.md`` (one row per mode: throughput and its ratio to target-only in the same run,
target passes, tokens per pass, requests with target-only's exact tokens; then tokens per pass by
template) and ``suffix_study.png`` (throughput ratio and tokens per pass per mode) beside it.
"""

from __future__ import annotations

import pathlib
import sys

from experiments.lib import toolkit


def render(records) -> str:
    setup = next(r for r in records if r["kind"] == "setup")
    modes = [r for r in records if r["kind"] == "mode"]
    lines = [f"# Suffix study: {setup['requests']} requests of {len(set(setup['templates']))} templates, "
             f"gamma {setup['gamma']}, {setup['max_new_tokens']} new tokens, greedy", ""]
    lines += toolkit.provenance_lines(setup["provenance"]) + [""]
    lines += ["| slots | mode | tokens/s | vs target-only | target passes | tokens per pass | same tokens as target-only |",
              "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in modes:
        base = next((b for b in modes if b["mode"] == "target-only" and b["slots"] == r["slots"]), None)
        ratio = r["throughput_tok_s"] / base["throughput_tok_s"] if base else float("nan")
        lines.append(f"| {r['slots']} | {r['mode']} | {r['throughput_tok_s']:.1f} | {ratio:.2f}x | {r['row_rounds']} | "
                     f"{r['mean_accepted_tokens_per_pass']:.2f} | {r['same_tokens_as_target_only']}/{r['requests']} |")
    templates = sorted(set(setup["templates"]))
    lines += ["", "Tokens per target pass by template:", "",
              "| slots | mode | " + " | ".join(templates) + " |", "| ---: | --- |" + " ---: |" * len(templates)]
    for r in modes:
        by = r["tokens_per_pass_by_template"]
        lines.append(f"| {r['slots']} | {r['mode']} | " + " | ".join(f"{by.get(t, float('nan')):.2f}" for t in templates) + " |")
    return "\n".join(lines) + "\n"


def plot(path) -> pathlib.Path:
    plt = toolkit.pyplot()
    records = toolkit.read_jsonl(path)
    setup = next(r for r in records if r["kind"] == "setup")
    modes = [r for r in records if r["kind"] == "mode"]
    base = {r["slots"]: r for r in modes if r["mode"] == "target-only"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 0.5 * len(modes) + 2))
    names = [f"{r['mode']}, {r['slots']} slot{'s' if r['slots'] > 1 else ''}" for r in modes]
    a.barh(names, [r["throughput_tok_s"] / base[r["slots"]]["throughput_tok_s"] for r in modes],
           color=[f"C{sorted(base).index(r['slots'])}" for r in modes])
    a.axvline(1.0, color="k", lw=0.8)
    a.set_xlabel("throughput / target-only (same run)")
    b.barh(names, [r["mean_accepted_tokens_per_pass"] for r in modes], color="C1")
    b.set_xlabel("committed tokens per target pass")
    b.set_yticklabels([])
    fig.suptitle(f"Repetitive workload: {setup['requests']} requests, greedy\n"
                 + toolkit.run_caption(setup["provenance"]), fontsize=9)
    fig.tight_layout()
    return toolkit.save_figure(fig, pathlib.Path(path).with_name("suffix_study.png"))


def write(path) -> list[pathlib.Path]:
    path = pathlib.Path(path)
    md = path.with_name("results.md")
    md.write_text(render(toolkit.read_jsonl(path)))
    return [md, plot(path)]


if __name__ == "__main__":
    for p in write(sys.argv[1] if len(sys.argv) > 1 else "experiments/suffix_study/results/results.jsonl"):
        print(p)
