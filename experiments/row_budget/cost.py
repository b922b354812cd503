"""What a round with a gamma per row costs: row budgets against dense rounds, one run.

    python -m experiments.row_budget.cost [--batch_sizes=4,16] [--widths=1.5,2,2.5,3] [--out=...]

SmolLM2-135M-Instruct in the main command's CPU layout ("packed": the panel matmul), the shipped
draft head, greedy, the B shortest of 32 held-out Spec-Bench prompts. Per batch size B: the median wall time of one
engine round (`Engine.round_times`: donated state, the candidates taken in turn) of target-only
decoding (gamma 0), a dense chain of gamma 3 (every row scores 4 positions) and a row budget of
gamma 3 at each width (`specjax.RowBudget`: width x B positions in all, packed in the target's
pass), and of the target's verification pass alone at the same sizes (dense [B, 4] against
packed). Ratios against the dense gamma-3 round come from the same run. One JSONL record per
batch size (`experiments/row_budget/results/cost.jsonl`), with the machine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from absl import app, flags

BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["4", "16"], "rows per round")
WIDTHS = flags.DEFINE_list("widths", ["1.5", "2", "2.5", "3"], "row budgets' positions per row (root included)")
GAMMA = flags.DEFINE_integer("gamma", 3, "the dense chain's gamma and the budgets' largest")
REPEATS = flags.DEFINE_integer("repeats", 7, "timed rounds per candidate (median)")
OUT = flags.DEFINE_string("out", "experiments/row_budget/results/cost.jsonl", "JSONL to append to")


def measure() -> list[dict]:
    from specjax import build, decoding, models, sampling
    from specjax.decoding import AdaptiveGamma, RowBudget

    from experiments.lib import toolkit, workload
    build.tune_xla_cpu()
    c = toolkit.load_config(toolkit.REPO / "experiments" / "bench_speed" / "config.py")
    c.update(num_prompts=32, layers="packed")
    w = workload.load(ml_collections.ConfigDict(c.to_dict()), "/tmp/specjax-row-budget")
    drafter, dparams = workload.drafter(w, "head", c)
    params = decoding.EngineParams(target=w.params, draft=dparams)
    G = GAMMA.value
    budgets = tuple(RowBudget(G, float(x)) for x in WIDTHS.value)
    cfg = decoding.GenerationConfig(max_new_tokens=128, gamma=AdaptiveGamma(gammas=(0, G) + budgets),
                                    verifier="token", eos_ids=w.eos_ids)
    engine = decoding.Engine(w.target, drafter, cfg)
    greedy = sampling.SamplingConfig.make(0.0)
    prompts = sorted(w.prompts, key=lambda p: len(p.ids))
    records = []
    with toolkit.CompileLog() as log:
        for B in (int(b) for b in BATCH_SIZES.value):
            rows = [list(p.ids) for p in prompts[:B]]            # the B shortest
            capacity = -(-cfg.slots_needed(max(len(r) for r in rows)) // 64) * 64
            batch = decoding.make_batch(rows, cfg, jax.random.key(0), capacity=capacity)
            round_s = engine.round_times(params, greedy, batch, repeats=REPEATS.value)
            names = ["gamma 0", f"gamma {G}"] + [str(b) for b in budgets]
            # the verification pass alone: dense [B, G + 1] against each budget's packed slots
            state = engine.init(params, batch)
            toks = jnp.zeros((B, G + 1), jnp.int32)
            fwd = jax.jit(lambda p, t, cc, r: w.target.apply_with_features(p, t, cc, layers=drafter.feature_layers,
                                                                           rows=r)[:2])
            dense = jax.jit(lambda p, t, cc: w.target.apply_with_features(p, t, cc, layers=drafter.feature_layers)[:2])
            pass_s = {f"gamma {G}": toolkit.time_calls(dense, w.params, toks, state.target_cache, iters=REPEATS.value,
                                                       log=log)["median_s"]}
            for b in budgets:
                rows = models.PackedRows.leading(jnp.full((B,), G + 1, jnp.int32), G + 1, b.slots(B))
                pass_s[str(b)] = toolkit.time_calls(fwd, w.params, toks, state.target_cache, rows,
                                                    iters=REPEATS.value, log=log)["median_s"]
            dense_s = round_s[1]
            rec = {"batch": B, "gamma": G, "model": w.name, "drafter": "head (shipped)",
                   "round_ms": {n: round(1e3 * t, 2) for n, t in zip(names, round_s)},
                   "round_vs_dense": {n: round(t / dense_s, 3) for n, t in zip(names, round_s)},
                   "slots": {str(b): b.slots(B) for b in budgets} | {f"gamma {G}": B * (G + 1), "gamma 0": B},
                   "pass_ms": {n: round(1e3 * t, 2) for n, t in pass_s.items()},
                   "pass_vs_dense": {n: round(t / pass_s[f"gamma {G}"], 3) for n, t in pass_s.items()}}
            print(rec, flush=True)
            records.append(rec)
            jax.clear_caches()
    return records


def main(argv):
    del argv
    from experiments.lib import toolkit
    toolkit.append_records("experiments.row_budget.cost", measure, OUT.value)


if __name__ == "__main__":
    app.run(main)
