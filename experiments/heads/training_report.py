"""The heads' training table (issue 14) from `experiments/heads/train.py`'s summaries:

    python -m experiments.heads.training_report [experiments/heads/results] > TRAINING.md

One row per `train-<kind>.json` there: loss tokens and wall time of the run (with the part spent
generating the target's data and features, which the first run on a fresh cache pays), and its last
held-out evaluation (Spec-Bench held-out prompts, the target's greedy continuations, teacher
forced; `specjax.distill` evaluation): alpha at T = 1, greedy agreement of the head's k-th
autoregressive proposal for k = 1..3, and accepted tokens per target pass of a greedy chain of
length gamma simulated on those continuations; each run's command, commit and machine below.
"""

from __future__ import annotations

import json
import pathlib
import sys

from experiments import toolkit

ORDER = ("eagle3", "eagle", "medusa")


def render(results_dir: pathlib.Path) -> str:
    runs = {p.stem.removeprefix("train-"): json.loads(p.read_text())
            for p in sorted(results_dir.glob("train-*.json"))}
    kinds = [k for k in ORDER if k in runs] + sorted(set(runs) - set(ORDER))
    rows, notes = [], []
    for k in kinds:
        s, prov = runs[k]["summary"], runs[k]["provenance"]
        e = s["eval"]
        best_g = max(range(1, 6), key=lambda g: e.get(f"greedy_tokens_per_pass_g{g}", 0.0))
        rows.append([k, s["tokens"], toolkit.fmt(s["wall_s"] / 60, 1), toolkit.fmt(s.get("target_data_s", 0.0) / 60, 1),
                     toolkit.fmt(s["train_tokens_per_s"], 0),
                     toolkit.fmt(e["alpha_t1"]), toolkit.fmt(e["greedy_agreement_step1"]),
                     toolkit.fmt(e.get("greedy_agreement_step2")), toolkit.fmt(e.get("greedy_agreement_step3")),
                     toolkit.fmt(e["greedy_tokens_per_pass_g1"]),
                     f"{toolkit.fmt(e[f'greedy_tokens_per_pass_g{best_g}'])} (γ = {best_g})"])
        m = prov["machine"]
        notes.append(f"- {k}: `{prov['command']}`, commit `{prov['git_commit'][:10]}`, {prov['date_utc']}, "
                     f"{m['cpu_model']} ({m['cpus_usable']} CPUs, load {m['loadavg_at_start']} at start), "
                     f"{e['eval_tokens']} held-out tokens evaluated")
    return "\n".join([
        "# Draft heads: training and held-out evaluation", "",
        toolkit.table(["head", "loss tokens", "wall (min)", "of which target data (min)",
                       "train tokens/s", "alpha (T = 1)",
                       "greedy agreement k=1", "k=2", "k=3", "tokens/pass γ = 1", "best chain"], rows),
        "", *notes, ""])


if __name__ == "__main__":
    print(render(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "experiments/heads/results")))
