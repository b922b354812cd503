"""Greedy exactness at full size: speculative vs target-only greedy on the real target.

    python -m experiments.greedy_exactness.run --num_prompts=48 --max_new_tokens=128 \
        --out=experiments/greedy_exactness/results.jsonl

Held-out Spec-Bench prompts (round-robin over categories), each drafter; the near-tie rule
of `specjax.decoding._greedy_check` applies (mismatch allowed only where the target-only
top-2 logit gap < eps; reported, then teacher-forced). One JSONL record per (drafter, prompt)
plus one summary record per drafter, each with the git commit and the GGUF sha256.
"""

from __future__ import annotations

import json
import subprocess
import time

from absl import app, flags

from specjax import build, specbench
from specjax.decoding._greedy_check import NEAR_TIE_EPS, greedy_check, reference_greedy
from specjax.models import registry
from specjax.models.tokenizer import load_tokenizer

_N = flags.DEFINE_integer("num_prompts", 48, "held-out prompts, round-robin over categories")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "new tokens per prompt")
_BATCH = flags.DEFINE_integer("batch_size", 4, "rows per generate call")
_DRAFTERS = flags.DEFINE_list("drafters", ["ngram:4", "early_exit:1"], "kind:gamma pairs")
_OUT = flags.DEFINE_string("out", "experiments/greedy_exactness/results.jsonl", "JSONL output")


def round_robin_prompts(n: int):
    by_cat = {c: [q for q in specbench.load(split="held_out") if q.category == c] for c in specbench.CATEGORIES}
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        out.extend(v[i] for v in by_cat.values() if i < len(v))
        i += 1
    return out[:n]


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def main(argv):
    del argv
    target, params = build.load_target(registry.DEFAULT_MODEL)
    tok = load_tokenizer(registry.DEFAULT_MODEL)
    questions = round_robin_prompts(_N.value)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q.prompt}]) for q in questions]
    prov = {"commit": git_commit(), "gguf_sha256": registry.KNOWN[registry.DEFAULT_MODEL].sha256,
            "eps": NEAR_TIE_EPS, "max_new_tokens": _MAX_NEW.value, "batch_size": _BATCH.value}
    t0 = time.time()
    refs = reference_greedy(target, params, prompts, _MAX_NEW.value, batch_size=_BATCH.value)
    print(f"references: {time.time() - t0:.0f}s", flush=True)
    with open(_OUT.value, "w") as f:
        for spec in _DRAFTERS.value:
            kind, gamma = spec.split(":")
            drafter, dparams = build.make_drafter(kind, target, params, early_exit_layers=4)
            t0 = time.time()
            reports = greedy_check(target, params, drafter, dparams, prompts, _MAX_NEW.value, int(gamma),
                                   references=refs, batch_size=_BATCH.value)
            for q, r in zip(questions, reports):
                f.write(json.dumps({**prov, "drafter": kind, "gamma": int(gamma), "question_id": q.question_id,
                                    "category": q.category, "ok": r.ok, "tokens_compared": r.tokens_compared,
                                    "near_ties": r.near_ties, "hard_mismatch": r.hard_mismatch,
                                    "rounds": r.rounds, "proposed": r.proposed, "accepted": r.accepted,
                                    "full_accept_rounds": r.full_accept_rounds}) + "\n")
            summary = {**prov, "drafter": kind, "gamma": int(gamma), "summary": True, "prompts": len(reports),
                       "question_ids": [q.question_id for q in questions],
                       "hard_mismatches": sum(not r.ok for r in reports),
                       "near_ties": sum(len(r.near_ties) for r in reports),
                       "tokens_compared": sum(r.tokens_compared for r in reports),
                       "proposed": sum(r.proposed for r in reports), "accepted": sum(r.accepted for r in reports),
                       "full_accept_rounds": sum(r.full_accept_rounds for r in reports),
                       "seconds": time.time() - t0}
            f.write(json.dumps(summary) + "\n")
            f.flush()
            print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    app.run(main)
