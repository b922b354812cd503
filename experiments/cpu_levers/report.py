"""`results.md` of the CPU levers study, from its JSONL alone:
``python -m experiments.cpu_levers.report RESULTS.jsonl``."""
from __future__ import annotations

import sys

from experiments.lib import toolkit


def render(records: list[dict]) -> str:
    vs = [r for r in records if r.get("kind") == "variant"]
    if not vs:
        return "no variant records\n"
    prov = vs[0]["provenance"]
    ks = sorted({int(k) for r in vs for k in r["forward_ms"]})
    base = next((r for r in vs if r["variant"] == "float32 kernel, 1 device"), vs[0])
    lines = ["# CPU levers: bfloat16 and the model-parallel mesh", "", *toolkit.provenance_lines(prov), "",
             f"One target forward of k tokens at batch 1 (ms, and in one-token steps of the same variant); "
             f"greedy decoding tokens/s (decode only, {vs[0]['rows']} held-out prompts); prompt lookup at "
             f"fixed gamma against target-only of the same variant; 'vs {base['variant']}': target-only "
             f"tokens/s over that variant's. 'same tokens': prompts whose speculative "
             f"tokens equal target-only's as run; the exactness check (`decoding.greedy_check`) teacher-forces "
             f"past near-ties (top-2 gap below eps = max(1e-3, 2 x the measured block-vs-incremental logit "
             f"rounding)); a hard mismatch is a gap >= eps.", ""]
    head = ["variant", *[f"k={k} ms" for k in ks], *[f"k={k}/k=1" for k in ks if k > 1],
            "target-only tok/s", f"vs {base['variant']}", "prompt lookup", "tokens/pass", "same tokens",
            "logit rounding", "near-tie eps", "near-ties", "hard mismatches"]
    rows = []
    for r in vs:
        ms = {int(k): v for k, v in r["forward_ms"].items()}
        rel = {int(k): v for k, v in r["forward_rel"].items()}
        rows.append([r["variant"], *[toolkit.fmt(ms.get(k), 1) for k in ks],
                     *[toolkit.fmt(rel.get(k), 2) for k in ks if k > 1],
                     toolkit.fmt(r["target_only_tokens_per_s"], 1),
                     toolkit.fmt(r["target_only_tokens_per_s"] / base["target_only_tokens_per_s"], 2) + "x",
                     toolkit.fmt(r["speedup_ngram"], 2) + "x", toolkit.fmt(r["mean_accepted_tokens_per_pass"], 2),
                     f"{r['greedy_equal_rows']}/{r['rows']}", f"{r['logit_rounding']:.1e}", f"{r['near_tie_eps']:.1e}",
                     str(r["near_ties"]), str(len(r["hard_mismatches"]))])
    lines.append(toolkit.table(head, rows))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(toolkit.read_jsonl(sys.argv[1])), end="")
