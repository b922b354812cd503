"""The cost of a whole-sequence forward against ``ModelConfig.causal_chunk``.

    python -m experiments.heads.causal_chunk_cost [--out=experiments/heads/results/causal_chunk_cost.jsonl]

A head's feature pass runs SmolLM2-135M over every position of the data engine's answer shards
(`specjax.distill.ShardFeatures`: its residual stream after layers 1, 14, 26 and 29), in batches
of 8,192 positions bucketed by width. This times that forward (`shard_feature_forward`, float32,
random token ids: the cost does not depend on them) at the stream's widths, with the reference
op attending in one block (``causal_chunk=0``) and in query chunks of 64 and 128, all in one run:
best of 2 after a compile, per width and chunk. Then the positions per second of a whole pass,
the widths weighted by their share of the long runs' positions (one epoch of the stream of
`experiments/learning_curve/config.py:long`). One JSONL record per chunk setting, with the machine.
"""

from __future__ import annotations

import dataclasses
import json
import time

from absl import app, flags

OUT = flags.DEFINE_string("out", "experiments/heads/results/causal_chunk_cost.jsonl", "JSONL to append to")
CHUNKS = (0, 64, 128)
POSITIONS = 8192
LAYERS = (1, 14, 26, 29)


def _width_shares() -> dict[int, float]:
    import collections

    from experiments.lib import engine_data
    from specjax.distill import ShardStream
    st = ShardStream(engine_data.stage_dirs("responses_greedy", "responses_sampled", "followup_responses"),
                     seed=0, tokens_per_batch=2048, widths=engine_data.WIDTHS, window=engine_data.WINDOW)
    c = collections.Counter()
    for W, _ in st.epoch(0):
        c[W] += st.rows_for(W) * W
    total = sum(c.values())
    return {W: n / total for W, n in sorted(c.items())}


def measure() -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import build
    from specjax import distill
    model, tp = build.load_target("smollm2-135m-instruct")[:2]
    shares = _width_shares()
    rows = []
    secs = {c: {} for c in CHUNKS}
    for W in shares:
        toks = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (POSITIONS // W, W)),
                           jnp.int32)
        fns = {c: jax.jit(lambda p, t, fwd=distill.shard_feature_forward(dataclasses.replace(
                              model, config=model.config.replace(causal_chunk=c))):
                          fwd(p, t, LAYERS)) for c in CHUNKS}
        for c in CHUNKS:
            jax.block_until_ready(fns[c](tp, toks))
        best = {c: float("inf") for c in CHUNKS}
        for _ in range(2):                        # the settings take turns, so drift hits all alike
            for c in CHUNKS:
                t0 = time.perf_counter()
                jax.block_until_ready(fns[c](tp, toks))
                best[c] = min(best[c], time.perf_counter() - t0)
        for c in CHUNKS:
            secs[c][W] = best[c]
        print(json.dumps({"width": W, **{f"chunk_{c}_s": round(best[c], 3) for c in CHUNKS}}), flush=True)
    for c in CHUNKS:
        per_pos = sum(shares[W] * secs[c][W] / POSITIONS for W in shares)
        rows.append({"causal_chunk": c, "positions_per_batch": POSITIONS, "layers": list(LAYERS),
                     "seconds_by_width": {str(W): round(t, 3) for W, t in secs[c].items()},
                     "positions_per_s_by_width": {str(W): round(POSITIONS / t, 1) for W, t in secs[c].items()},
                     "width_shares": {str(W): round(v, 4) for W, v in shares.items()},
                     "pass_positions_per_s": round(1.0 / per_pos, 1),
                     "pass_vs_one_block": round(sum(shares[W] * secs[0][W] for W in shares)
                                                / sum(shares[W] * secs[c][W] for W in shares), 3)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv):
    del argv
    from experiments.lib import toolkit
    toolkit.append_records("experiments.heads.causal_chunk_cost", measure, OUT.value)


if __name__ == "__main__":
    app.run(main)
