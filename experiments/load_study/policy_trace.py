"""The load-aware policy's choices round by round for single requests of the load study.

    python -m experiments.load_study.policy_trace experiments/load_study/results/results.jsonl 10 22 1

For each request index (into the study's 24 four-slot prompts, the same seeded sample), one row
decodes alone with the load-aware hybrid, priced with the one-row round times the study
calibrated for its 4-slot group, starting from a fresh policy. Per round: the gamma the policy
chose for it (the previous round's `Commit.next_index`), the row's accepted / tested draft
positions before the round, each draft source's running acceptance estimate before it
(`state.policy.alpha_R`: the head, then prompt lookup) and the tokens the round committed.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from experiments.lib import toolkit
from experiments.load_study import run as study


def trace(results_jsonl: str, ids, rounds: int = 40) -> str:
    from specjax import decoding, sampling
    c = toolkit.load_config("experiments/load_study/config.py")
    gc, target, params, eos, prompts, _, _ = study._setup(c, max(c.num_requests))
    engine, eparams = study._engine(c, gc, target, params, eos, "load-aware hybrid")
    recs = [json.loads(line) for line in open(results_jsonl)]
    cal = next(r for r in recs if r["kind"] == "calibration" and r["slots"] == 4)["round_time_s"]
    samp = sampling.SamplingConfig.make(temperature=0.0)
    setup = next(r for r in recs if r["kind"] == "setup")
    gammas = engine.config.gammas
    out = []
    for rid in ids:
        batch = decoding.make_batch([prompts[rid]], engine.config, jax.random.key(0), capacity=setup["capacity"],
                                    pad_multiple=64)
        state = engine.init(eparams, batch, cal["1"])
        lines, chosen = [], None
        for _ in range(rounds):
            acc, tst = int(np.sum(state.metrics.accepted_at_BG)), int(np.sum(state.metrics.tested_at_BG))
            alpha_R = np.asarray(state.policy.alpha_R).round(2).tolist()
            state, commit = engine.step(eparams, samp, state)
            g = "first" if chosen is None else f"gamma {gammas[chosen]}"
            lines.append(f"{g}: accepted/tested {acc}/{tst}, source estimates {alpha_R}, committed {int(commit.n_B[0])}")
            chosen = int(commit.next_index)
            if bool(state.done_B[0]):
                break
        out.append(f"request {rid}:\n  " + "\n  ".join(lines))
    return "\n".join(out)


if __name__ == "__main__":
    print(trace(sys.argv[1], [int(x) for x in sys.argv[2:]]))
