"""What running a head's later drafting steps at the loss's origins only saves per training step.

    python -m experiments.heads.origins_cost [--batches=12] [--out=experiments/heads/results/origins_cost.jsonl]

For each kind of the long learning-curve runs (EAGLE-3 with 7 drafting steps, the parallel
drafter with a block of 4; SmolLM2-135M's dimensions, 8,192-token head, float32) it times the
jitted training step (`specjax.distill.make_train_step` with `head_loss`: forward, backward and
the AdamW update) on the same batches twice: over every position, and with the origins its loss
reads attached (`specjax.distill.with_loss_origins`, what the distillation loop does), and a
third time on batches of the stream grouped by answer length (``data.shards.group_by_length``,
as the long runs are; other batches, so that variant is compared by loss tokens per second).
The batches are real: `--batches` drawn (seed 0) from one epoch of the data engine's answer
shards as the long runs stream them (2,048 positions a batch, widths 128-1,024), with random
features in place of the cached ones (the step's cost does not depend on their values). Every
shape is compiled first; then the variants take turns batch by batch, their order rotating, so
drift hits all alike. One JSONL record per kind: seconds per variant summed over its batches,
loss tokens per second and their ratio to every position's, and the mean Q / T of the origins
over the sample and over a whole epoch of each order; with the machine and the commit.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

BATCHES = flags.DEFINE_integer("batches", 12, "batches drawn from one epoch of the stream")
OUT = flags.DEFINE_string("out", "experiments/heads/results/origins_cost.jsonl", "JSONL to append to")
KINDS = (("eagle3", dict(ttt_steps=7)), ("parallel", dict(num_heads=4)))


def _stream(grouped: bool):
    from experiments.lib import engine_data
    from specjax.distill import ShardStream
    return ShardStream(engine_data.stage_dirs("responses_greedy", "responses_sampled", "followup_responses"),
                       seed=0, tokens_per_batch=2048, widths=engine_data.WIDTHS, window=engine_data.WINDOW,
                       group_by_length=grouped)


def _batches(n: int, feature_size: int, hidden: int, grouped: bool = False) -> list[dict]:
    import numpy as np
    stream = _stream(grouped)
    rng = np.random.default_rng(0)
    out = []
    for i in sorted(rng.choice(stream.batches_per_epoch, n, replace=False).tolist()):
        b = stream.batch(int(i))
        B, W = b["tokens"].shape
        b["features"] = rng.standard_normal((B, W, feature_size)).astype(np.float16)
        b["final_residual"] = rng.standard_normal((B, W, hidden)).astype(np.float16)
        out.append(b)
    return out


def _epoch(grouped: bool):
    """Every batch of epoch 0 (tokens and mask only)."""
    stream = _stream(grouped)
    for i in range(stream.batches_per_epoch):
        yield stream.batch(i)


def _q_over_t(batches, shifts=None) -> float:
    """Origins run over positions, all batches pooled: the origins attached to each batch, or
    with ``shifts`` those `loss_origins` picks for it (a batch given none counts its width)."""
    from specjax import distill
    q = t = 0
    for b in batches:
        B, T = b["mask"].shape
        if shifts is None:
            o = b.get("origins")
        else:
            got = distill.loss_origins(b["mask"], shifts)
            o = None if got is None else got[0]
        q += B * (T if o is None else o.shape[1])
        t += B * T
    return q / t


def measure(n: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from experiments.heads import head_bench
    from specjax import build, distill
    model, tp = build.load_target("smollm2-135m-instruct")[:2]
    ids = np.arange(8192)
    head_UD = distill.teacher_head(model, tp, ids)
    rows = []
    for kind, opts in KINDS:
        hc, obj, opt, state, frozen = head_bench.fresh_head(model, tp, kind, opts, ids)
        step = distill.make_train_step(obj, distill.LossSpec("fkl"), opt, loss=distill.head_loss)
        plain = _batches(n, hc.feature_size, model.config.hidden_size)
        gathered = [distill.with_loss_origins(obj, b) for b in plain]
        grouped = [distill.with_loss_origins(obj, b)
                   for b in _batches(n, hc.feature_size, model.config.hidden_size, grouped=True)]
        variants = {"every_position": plain, "loss_origins": gathered, "loss_origins_grouped": grouped}
        put = lambda b: {k: jnp.asarray(v) for k, v in b.items()}      # noqa: E731
        for bs in variants.values():                                   # compile every shape
            for b in bs:
                state, aux = step(state, frozen, head_UD, put(b))
                jax.block_until_ready(aux["loss"])
        secs = {name: 0.0 for name in variants}
        names = list(variants)
        for i in range(n):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                b = put(variants[name][i])
                t0 = time.perf_counter()
                state, aux = step(state, frozen, head_UD, b)
                jax.block_until_ready(aux["loss"])
                secs[name] += time.perf_counter() - t0
        tokens = {k: float(sum(b["mask"].sum() for b in bs)) for k, bs in variants.items()}
        rate = {k: tokens[k] / secs[k] for k in variants}
        shifts = hc.spec.train_shifts(hc, obj.ttt_steps)
        rec = {"kind": kind, **opts, "batches": n, "loss_tokens": {k: int(v) for k, v in tokens.items()},
               "seconds": {k: round(v, 3) for k, v in secs.items()},
               "loss_tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
               "rate_vs_every_position": {k: round(rate[k] / rate["every_position"], 3) for k in variants},
               "q_over_t_sample": {k: round(_q_over_t(bs), 3) for k, bs in variants.items() if k != "every_position"},
               "q_over_t_epoch": {"shuffled": round(_q_over_t(_epoch(False), shifts), 3),
                                  "grouped": round(_q_over_t(_epoch(True), shifts), 3)}}
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    return rows


def main(argv):
    del argv
    from experiments.lib import toolkit
    toolkit.append_records("experiments.heads.origins_cost", lambda: measure(BATCHES.value), OUT.value)


if __name__ == "__main__":
    app.run(main)
