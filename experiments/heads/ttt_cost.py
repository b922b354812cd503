"""Cost of the EAGLE-3 training-time test's attention: the structured rule against dense masks.

    python -m experiments.heads.ttt_cost [--out=experiments/heads/results/ttt_cost.jsonl]

Times the forward and backward (`jax.grad` of a scalar of the outputs) of
`specjax.drafters.eagle_train_forward` over 7 drafting steps for an EAGLE-3 head on
SmolLM2-135M's dimensions (random weights and features: the cost does not depend on them), at
batch shapes of 2048 positions, with the attention of steps 2..7 as
`specjax.models.attention.TrainingTimeTest` (a causal block plus diagonal entries) and as the
equivalent dense masks (``dense_visibility=True``). Best of 3 after a compile; one JSONL record
per shape with the CPU, the load average and the commit.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

OUT = flags.DEFINE_string("out", "experiments/heads/results/ttt_cost.jsonl", "JSONL to append to")
SHAPES = ((2, 1024), (4, 512), (8, 256), (16, 128))


def measure(steps: int = 7, shapes=SHAPES, repeats: int = 3) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import build, drafters

    model, tp = build.load_target("smollm2-135m-instruct")[:2]
    hc = drafters.HeadConfig.make("eagle3", model.config, head_size=8192, input_norm=True)
    own = drafters.init_head_params(hc, jax.random.key(0), head_ids=jnp.arange(8192, dtype=jnp.int32))
    weights = {k: v for k, v in own.items() if k != "head_ids"}
    rows = []
    for B, T in shapes:
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (B, T)), jnp.int32)
        feats = jax.random.normal(jax.random.key(1), (B, T, hc.feature_size))
        rec = {"batch": B, "width": T, "steps": steps}
        for name, dense in (("dense_s", True), ("structured_s", False)):
            def loss(w, dense=dense):
                hp = drafters.head_params(hc, {**own, **w}, tp)
                outs = drafters.eagle_train_forward(hc, hp, tokens, feats, steps=steps, with_logits=False,
                                                    dense_visibility=dense)
                return sum(jnp.mean(h * h) for h, _ in outs)
            f = jax.jit(jax.grad(loss))
            jax.block_until_ready(f(weights))
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(f(weights))
                best = min(best, time.perf_counter() - t0)
            rec[name] = best
        rec["speedup"] = rec["dense_s"] / rec["structured_s"]
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    return rows


def main(argv):
    del argv
    from experiments.lib import toolkit
    toolkit.append_records("experiments.heads.ttt_cost", measure, OUT.value)


if __name__ == "__main__":
    app.run(main)
