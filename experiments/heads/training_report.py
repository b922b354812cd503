"""The heads' training table (issue 14) from `experiments/heads/train.py`'s summaries:

    python -m experiments.heads.training_report [experiments/heads/results] > TRAINING.md

One row per `train-<name>.json` there: head kind, input norm, training-time feature noise, the
training data (the target's greedy / temperature-1 continuations per train prompt and whether the
second turns are in, from the run's config; its loss tokens from the summary, or for summaries
older than that record from a run with the same data settings, named),
loss tokens trained on, the median training
throughput of its steps (from `train-<name>.jsonl`, over every invocation of a resumed run), and its last
held-out evaluation (Spec-Bench held-out prompts, the target's greedy continuations, teacher
forced; `specjax.distill` evaluation): alpha at T = 1, greedy agreement of the head's k-th
autoregressive proposal for k = 1..3, and accepted tokens per target pass of a greedy chain of
length gamma simulated on those continuations; each run's command, commit and machine below.

A second table sets each held-out evaluation of a run beside the head's agreement on its own
training batches since the evaluation before (``agreement_on_head``: teacher-forced, over the
head's vocabulary): a head that learns its data and not the task shows the gap.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

from experiments.lib import toolkit
from experiments.lib.head_runs import DATA_DEFAULTS, data_tokens, read_summary

ORDER = ("eagle3", "eagle", "medusa")


def _history(jsonl: pathlib.Path) -> tuple[float | None, list[dict]]:
    """(median tokens/s over the run's training steps, its resume events) from its metrics."""
    if not jsonl.is_file():
        return None, []
    recs = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in recs if r.get("kind") == "train" and r.get("tokens_per_s")]
    return (float(np.median(rates)) if rates else None), [r for r in recs if r.get("event") == "resume"]


def generalization(jsonl: pathlib.Path) -> list[list]:
    """Rows [loss tokens, training agreement since the previous evaluation, held-out greedy
    agreement] for every held-out evaluation after the first of a run's metrics."""
    if not jsonl.is_file():
        return []
    recs = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    rows, window = [], []
    for r in recs:
        if r.get("kind") == "train" and "agreement_on_head" in r:
            window.append(r["agreement_on_head"])
        elif r.get("kind") == "eval" and window:
            rows.append([r["tokens"], float(np.mean(window)), r["greedy_agreement_step1"]])
            window = []
    return rows


def data_mix(config: dict) -> str:
    """'greedy/sampled/second turns' continuations per train prompt ('?' where the config lacks
    it) when the run trained on the target's Spec-Bench data, and the data engine's shard
    directories (``shards: a, b``) when it trained on those."""
    d = config.get("data", {})
    parts = []
    if d.get("target_weight", 1.0) > 0:
        turns = {True: "yes", False: "no"}.get(d.get("second_turns", DATA_DEFAULTS["data.second_turns"]), "?")
        parts.append(f"{d.get('greedy_samples', '?')}/{d.get('sampled_samples', '?')}/{turns}")
    sh = d.get("shards") or {}
    if sh.get("weight", 0) > 0:
        parts.append("shards: " + ", ".join(pathlib.Path(x).name for x in sh.get("dirs", ())))
    return "; ".join(parts) or "–"


def render(results_dir: pathlib.Path) -> str:
    runs = {p.stem.removeprefix("train-"): read_summary(p) for p in sorted(results_dir.glob("train-*.json"))}
    sizes = data_tokens(runs)
    kinds = [k for k in ORDER if k in runs] + sorted(set(runs) - set(ORDER))
    rows, notes = [], []
    for k in kinds:
        s, prov = runs[k]["summary"], runs[k]["provenance"]
        e = s["eval"]
        rate, resumes = _history(results_dir / f"train-{k}.jsonl")
        best_g = max(range(1, 6), key=lambda g: e.get(f"greedy_tokens_per_pass_g{g}", 0.0))
        size, source = sizes[k]
        size_text = "–" if size is None else (str(size) if source == k else f"{size} ({source})")
        rows.append([k, s["draft"]["kind"], "yes" if s["draft"].get("input_norm") else "no",
                     toolkit.fmt(float(s["draft"].get("feature_noise", 0.0)), 1), data_mix(prov.get("config", {})),
                     size_text, s["tokens"],
                     toolkit.fmt(rate, 0), toolkit.fmt(e["alpha_t1"]), toolkit.fmt(e["greedy_agreement_step1"]),
                     toolkit.fmt(e.get("greedy_agreement_step2")), toolkit.fmt(e.get("greedy_agreement_step3")),
                     toolkit.fmt(e["greedy_tokens_per_pass_g1"]),
                     f"{toolkit.fmt(e[f'greedy_tokens_per_pass_g{best_g}'])} (γ = {best_g})"])
        m = prov["machine"]
        resumed = "".join(f"; resumed at step {r['step']} ({r['tokens']} tokens)" for r in resumes)
        notes.append(f"- {k}: last invocation `{prov['command']}`, commit `{prov['git_commit'][:10]}`, "
                     f"{prov['date_utc']}, {m['cpu_model']} ({m['cpus_usable']} CPUs, load {m['loadavg_at_start']} "
                     f"at start){resumed}; {e['eval_tokens']} held-out tokens evaluated")
    gen_rows = [[k, t, toolkit.fmt(tr), toolkit.fmt(ho), toolkit.fmt(tr - ho)]
                for k in kinds for t, tr, ho in generalization(results_dir / f"train-{k}.jsonl")]
    return "\n".join([
        "# Draft heads: training and held-out evaluation", "",
        toolkit.table(["run", "kind", "input norm", "feature noise",
                       "data: greedy/sampled/2nd turns per Spec-Bench train prompt, or shards",
                       "data tokens", "loss tokens", "train tokens/s (median step)", "alpha (T = 1)",
                       "greedy agreement k=1", "k=2", "k=3", "tokens/pass γ = 1", "best chain"], rows),
        "", "Data tokens: the target loss tokens of the run's training data; \"N (run)\": the run's summary "
        "predates that record, and N is the record of that run, whose data settings (target, dtype, seed and "
        "every data setting the cached set is keyed by) are the same; \"–\": no such run.",
        "", *notes, "",
        "## Training batches against held-out prompts", "",
        toolkit.table(["run", "loss tokens", "agreement on training batches (since the last evaluation)",
                       "held-out greedy agreement k=1", "gap"], gen_rows), ""])


if __name__ == "__main__":
    print(render(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "experiments/heads/results")))
