"""The heads' training table (issue 14) from `experiments/heads/train.py`'s summaries:

    python -m experiments.heads.training_report [experiments/heads/results] > TRAINING.md

One row per `train-<name>.json` there: head kind, input norm, training-time feature noise, the
training data (the target's greedy / temperature-1 continuations per train prompt and whether the
second turns are in, from the run's config; its loss tokens where the summary records them),
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

from experiments import toolkit

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


def data_of(summary: dict, config: dict) -> tuple[str, str]:
    """(the training data's composition "greedy/sampled/second turns", its target loss tokens or
    '–' where the summary predates that record) of one run."""
    d = config.get("data", {})
    mix = f"{d.get('greedy_samples', '?')}/{d.get('sampled_samples', '?')}/{'yes' if d.get('second_turns') else 'no'}"
    counts = summary.get("data_loss_tokens")
    return mix, (str(sum(counts.values())) if counts else "–")


def render(results_dir: pathlib.Path) -> str:
    runs = {p.stem.removeprefix("train-"): json.loads(p.read_text())
            for p in sorted(results_dir.glob("train-*.json"))}
    kinds = [k for k in ORDER if k in runs] + sorted(set(runs) - set(ORDER))
    rows, notes = [], []
    for k in kinds:
        s, prov = runs[k]["summary"], runs[k]["provenance"]
        e = s["eval"]
        rate, resumes = _history(results_dir / f"train-{k}.jsonl")
        best_g = max(range(1, 6), key=lambda g: e.get(f"greedy_tokens_per_pass_g{g}", 0.0))
        mix, data_tokens = data_of(s, prov.get("config", {}))
        rows.append([k, s["draft"]["kind"], "yes" if s["draft"].get("input_norm") else "no",
                     toolkit.fmt(float(s["draft"].get("feature_noise", 0.0)), 1), mix, data_tokens, s["tokens"],
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
        toolkit.table(["run", "kind", "input norm", "feature noise", "data: greedy/sampled/2nd turns",
                       "data tokens", "loss tokens", "train tokens/s (median step)", "alpha (T = 1)",
                       "greedy agreement k=1", "k=2", "k=3", "tokens/pass γ = 1", "best chain"], rows),
        "", "Data tokens \"–\": the run's summary predates that record (before 2026-12-04); its data came "
        "from the same configuration as the later runs with the same composition (1/2/yes: 146,703 tokens).",
        "", *notes, "",
        "## Training batches against held-out prompts", "",
        toolkit.table(["run", "loss tokens", "agreement on training batches (since the last evaluation)",
                       "held-out greedy agreement k=1", "gap"], gen_rows), ""])


if __name__ == "__main__":
    print(render(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "experiments/heads/results")))
