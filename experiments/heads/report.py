"""The draft-head table (issue 14) from the benchmark's JSONL (bench_trees format):

    python -m experiments.heads.report [experiments/heads/results/results.jsonl]

Per drafter and chain length (trees in a table of their own), at each temperature: acceptance of the first proposal (at T = 0
this is greedy agreement), accepted tokens per target pass, the draft's cost per proposal
relative to a one-token target step (measured: the round's time less the measured cost of
scoring gamma + 1 tokens, per proposal), tokens/s against target-only decoding in the same run,
and the cost model's prediction (`specjax.analysis.RoundCost` from the measured draft cost and
pass costs, with alpha = the measured first-proposal acceptance, i.i.d. over positions).
"""

from __future__ import annotations

import sys

from experiments.lib import toolkit
from experiments.lib import tree_report as trees_report
from specjax import analysis


def _drafter_name(d: str) -> str:
    return d.split("/")[-1] + " head" if d.startswith("head:") else d


def render(records: list[dict]) -> str:
    prov = records[0]["provenance"]
    gens = [r for r in records if r["kind"] == "generation"]
    costs = {r["n"]: r["median_s"] for r in records if r["kind"] == "node_cost"}
    lines = ["# Feature-level draft heads against the distilled draft", ""] + toolkit.provenance_lines(prov) + [""]
    for temp in sorted({r["temperature"] for r in gens}):
        rows_t = [r for r in gens if r["temperature"] == temp]
        base = next(r for r in rows_t if r["drafter"] == "none")
        lines += [f"## T = {temp:g} (target-only: {base['tokens_per_s']:.1f} tokens/s over {base['prompts']} "
                  f"prompts, {base['new_tokens']} tokens)", ""]
        rows = []
        trees_rows = []
        for r in rows_t:
            if r["drafter"] == "none":
                continue
            if not r["setting"].startswith("chain:"):
                trees_rows.append([_drafter_name(r["drafter"]), r["setting"], toolkit.fmt(r["accepted_tokens_per_pass"]),
                                   toolkit.fmt(r["tokens_per_s"], 1),
                                   toolkit.fmt(r["tokens_per_s"] / base["tokens_per_s"]) + "x",
                                   toolkit.fmt(r.get("greedy_rows_matching"))])
                continue
            g = int(r["setting"].split(":")[1])
            alpha = r["accepted_at"][0] / max(r["tested_at"][0], 1)
            round_s = r["seconds"] / max(r["target_passes"], 1)
            draft_rel = pred = None
            if 1 in costs and g + 1 in costs:
                draft_s = max(round_s - costs[g + 1], 0.0) / g
                draft_rel = draft_s / costs[1]
                rc = analysis.RoundCost(draft_s=draft_s, verify_s={1: costs[1], g + 1: costs[g + 1]})
                pred = rc.predicted_speedup(min(alpha, 1 - 1e-9), g, costs[1])
            rows.append([_drafter_name(r["drafter"]), g, toolkit.fmt(alpha), toolkit.fmt(r["accepted_tokens_per_pass"]),
                         toolkit.fmt(draft_rel), toolkit.fmt(r["tokens_per_s"], 1),
                         toolkit.fmt(r["tokens_per_s"] / base["tokens_per_s"]) + "x",
                         (toolkit.fmt(pred) + "x") if pred is not None else "–",
                         toolkit.fmt(r.get("greedy_rows_matching"))])
        lines += [toolkit.table(["drafter", "gamma", "first-proposal acceptance", "accepted tokens / pass",
                                 "draft cost / target step", "tokens/s", "vs target-only", "cost model",
                                 "greedy rows = target-only"], rows), ""]
        if trees_rows:
            lines += [f"Token trees at T = {temp:g} (static `branching:k1,k2,..`; EAGLE-2 `dynamic:topk,depth,nodes`):",
                      "", toolkit.table(["drafter", "tree", "accepted tokens / pass", "tokens/s", "vs target-only",
                                         "greedy rows = target-only"], trees_rows), ""]
    if costs:
        lines += ["Target pass scoring N tokens (batch 1): " + ", ".join(
            f"N={n}: {costs[n] / costs[1]:.2f}x" for n in sorted(costs)) + f" (N=1: {1e3 * costs[1]:.1f} ms)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(trees_report.write(sys.argv[1] if len(sys.argv) > 1 else "experiments/heads/results/results.jsonl", render))
