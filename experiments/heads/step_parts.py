"""Where a head's training step spends its time: the whole step against its parts.

    python -m experiments.heads.step_parts [--batch=4] [--width=512] [--out=experiments/heads/results/step_parts.jsonl]

For EAGLE-3 with 7 drafting steps and the parallel drafter with a block of 4 (SmolLM2-135M's
dimensions, 8,192-token head, float32, random weights and features: the cost does not depend on
them), on one batch of ``batch`` x ``width`` positions whose first 30% are prompt (no loss),
it times, each jitted and best of 4 after a compile:

* ``step``: the training step (`make_train_step` with `head_loss`: forward, backward, AdamW);
* ``step_at_origins``: the same with the loss's origins attached (`with_loss_origins`);
* ``layer``: the head's layer alone over every drafting step, forward and backward (a scalar of
  its outputs; no vocabulary-sized work);
* ``vocabulary``: the vocabulary-sized work alone, forward and backward: the teacher's logits
  once, and per drafting step the head's logits over the 8,192 rows and the forward KL.

One JSONL record per kind with the seconds of each and positions per second, with the machine.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

BATCH = flags.DEFINE_integer("batch", 4, "rows")
WIDTH = flags.DEFINE_integer("width", 512, "positions per row")
OUT = flags.DEFINE_string("out", "experiments/heads/results/step_parts.jsonl", "JSONL to append to")
KINDS = (("eagle3", dict(ttt_steps=7)), ("parallel", dict(num_heads=4)))


def _best(f, repeats: int = 4) -> float:
    import jax
    jax.block_until_ready(f())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        best = min(best, time.perf_counter() - t0)
    return best


def measure(B: int, T: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from experiments.heads import head_bench
    from specjax import build, distill, drafters
    model, tp = build.load_target("smollm2-135m-instruct")[:2]
    ids = np.arange(8192)
    head_UD = distill.teacher_head(model, tp, ids)
    spec = distill.LossSpec("fkl")
    rng = np.random.default_rng(0)
    mask = np.zeros((B, T), np.float32)
    mask[:, T * 3 // 10:T - 1] = 1.0
    rows = []
    for kind, opts in KINDS:
        hc, obj, opt, state, frozen = head_bench.fresh_head(model, tp, kind, opts, ids)
        batch = {"tokens": rng.integers(0, 8000, (B, T)).astype(np.int32), "mask": mask,
                 "features": rng.standard_normal((B, T, hc.feature_size)).astype(np.float16),
                 "final_residual": rng.standard_normal((B, T, model.config.hidden_size)).astype(np.float16)}
        put = lambda b: {k: jnp.asarray(v) for k, v in b.items()}      # noqa: E731
        plain, at_origins = put(batch), put(distill.with_loss_origins(obj, batch))
        step = distill.make_train_step(obj, spec, opt, loss=distill.head_loss)
        holder = [state]

        def run_step(b):
            holder[0], aux = step(holder[0], frozen, head_UD, b)
            return aux["loss"]

        shifts = hc.spec.train_shifts(hc, obj.ttt_steps)
        rest = {k: v for k, v in frozen.items() if k != "target"}

        def layer_loss(w):
            hp = drafters.head_params(hc, {**w, **rest}, tp)
            outs = hc.spec.train_outputs(hc, hp, plain["tokens"], plain["features"].astype(jnp.float32),
                                         obj.ttt_steps)
            return sum(jnp.mean(h * h) for h, _ in outs)

        layer = jax.jit(jax.grad(layer_loss))
        h_BTD = jnp.asarray(rng.standard_normal((B, T, model.config.hidden_size)), jnp.float32)

        def shift(x, k):                # x[:, t + k] at t, zeros past the end
            return jnp.concatenate([x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)

        def vocab_loss(h):
            p = jax.lax.stop_gradient(jnp.einsum("btd,sd->bts", plain["final_residual"].astype(jnp.float32), head_UD))
            total = 0.0
            for k in shifts:
                q = jnp.einsum("btd,sd->bts", h + k, head_UD)
                div = distill.divergence("fkl", shift(p, k), q, 1.0, 0.5)
                m = shift(plain["mask"], k)
                total = total + jnp.sum(div * m) / jnp.maximum(jnp.sum(m), 1.0)
            return total

        vocab = jax.jit(jax.grad(vocab_loss))
        secs = {"step": _best(lambda: run_step(plain)), "step_at_origins": _best(lambda: run_step(at_origins)),
                "layer": _best(lambda: layer(holder[0].params)), "vocabulary": _best(lambda: vocab(h_BTD))}
        rec = {"kind": kind, **opts, "batch": B, "width": T, "origins_q": int(at_origins["origins"].shape[1])
               if "origins" in at_origins else T, "seconds": {k: round(v, 3) for k, v in secs.items()},
               "positions_per_s": {k: round(B * T / v, 1) for k, v in secs.items()}}
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    return rows


def main(argv):
    del argv
    from experiments.lib import toolkit
    toolkit.append_records("experiments.heads.step_parts", lambda: measure(BATCH.value, WIDTH.value), OUT.value)


if __name__ == "__main__":
    app.run(main)
