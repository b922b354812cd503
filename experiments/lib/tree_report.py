"""Tables (Markdown) and a plot from a bench_trees results.jsonl.

    python -m experiments.bench_trees.report experiments/bench_trees/results/results.jsonl
"""

from __future__ import annotations

import pathlib
import sys

from experiments.lib import toolkit


def _kind(setting: str) -> str:
    if setting == "adaptive":
        return "adaptive"
    return "chain" if setting.startswith("chain") else ("dynamic tree" if setting.startswith("dynamic")
                                                        else "static tree")


def by_sampling(records: list[dict]) -> list[tuple[float, float, dict, list[dict]]]:
    """(temperature, top_p, target-only record, drafter records) per sampling setting, in run order."""
    gens = [r for r in records if r["kind"] == "generation"]
    out = []
    for key in dict.fromkeys((r["temperature"], r.get("top_p", 1.0)) for r in gens):
        same = [r for r in gens if (r["temperature"], r.get("top_p", 1.0)) == key]
        out.append((*key, next(r for r in same if r["drafter"] == "none"), [r for r in same if r["drafter"] != "none"]))
    return out


def render(records: list[dict]) -> str:
    prov = records[0]["provenance"]
    gens = [r for r in records if r["kind"] == "generation"]
    costs = [r for r in records if r["kind"] == "node_cost"]
    lines = ["# Token trees: chain vs static vs dynamic tree", ""] + toolkit.provenance_lines(prov) + [""]
    for temp, top_p in sorted({(r["temperature"], r.get("top_p", 1.0)) for r in gens}):
        rows_t = [r for r in gens if (r["temperature"], r.get("top_p", 1.0)) == (temp, top_p)]
        base = next(r for r in rows_t if r["drafter"] == "none")
        nucleus = f", top-p {top_p:g}" if top_p != 1.0 else ""
        lines += [f"## T = {temp:g}{nucleus} (target-only: {base['tokens_per_s']:.1f} tokens/s, "
                  f"{base['new_tokens']} tokens over {base['prompts']} prompts)", ""]
        rows = []
        for r in rows_t:
            if r["drafter"] == "none":
                continue
            rows.append([r["drafter"], r["setting"], toolkit.fmt(r["tokens_scored_per_pass"], 1),
                         toolkit.fmt(r["accepted_tokens_per_pass"]), toolkit.fmt(r["tokens_per_s"], 1),
                         toolkit.fmt(r["tokens_per_s"] / base["tokens_per_s"]) + "x",
                         toolkit.fmt(r.get("greedy_rows_matching"))])
        lines += [toolkit.table(["drafter", "setting", "tokens scored / pass", "accepted tokens / pass", "tokens/s",
                                 "vs target-only", "greedy rows = target-only"], rows), ""]
        best = []
        for d in sorted({r["drafter"] for r in rows_t} - {"none"}):
            per = {}
            for r in rows_t:
                if r["drafter"] == d:
                    k = _kind(r["setting"])
                    if k not in per or r["tokens_per_s"] > per[k]["tokens_per_s"]:
                        per[k] = r
            chain = per.get("chain")
            for k, r in per.items():
                best.append([d, k, r["setting"], toolkit.fmt(r["accepted_tokens_per_pass"]),
                             toolkit.fmt(r["accepted_tokens_per_pass"] / chain["accepted_tokens_per_pass"]) + "x"
                             if chain else "–", toolkit.fmt(r["tokens_per_s"], 1),
                             toolkit.fmt(r["tokens_per_s"] / base["tokens_per_s"]) + "x"])
        lines += ["Best (by tokens/s) of each kind:", "",
                  toolkit.table(["drafter", "kind", "setting", "accepted tokens / pass", "vs best chain",
                                 "tokens/s", "vs target-only"], best), ""]
    if costs:
        one = next(r for r in costs if r["n"] == 1)["median_s"]
        lines += ["## Cost of one target pass scoring N tokens (tree block, batch 1)", "",
                  toolkit.table(["N", "median ms", "x one token"],
                                [[r["n"], toolkit.fmt(1e3 * r["median_s"]), toolkit.fmt(r["median_s"] / one)]
                                 for r in sorted(costs, key=lambda r: r["n"])]), ""]
    return "\n".join(lines)


def write(path, render_fn=None) -> str:
    """Render a results JSONL (with `render`, or another renderer of the same records) and write
    the text beside it as README.md."""
    path = pathlib.Path(path)
    text = (render_fn or render)(toolkit.read_jsonl(path))
    (path.parent / "README.md").write_text(text + "\n")
    return text


def entry():
    print(write(sys.argv[1] if len(sys.argv) > 1 else "experiments/bench_trees/results/results.jsonl"))
