"""Distillation data generation: the slot-refilling scheduler against length-bucketed batches.

    python -m experiments.load_study.datagen [--prompts=64] [--rows=32] [--max_new_tokens=128]

`specjax.distill.generate` (target-only, the target in the trainer's layout) on the first
`prompts` train-split Spec-Bench questions (chat template, those <= 512 tokens), greedy, both
ways in one process: ``slots=True`` (the default: a row whose request ends is refilled at once)
and ``slots=False`` (whole batches of `rows`, a batch ends with its longest row). Each is run
twice, the second timed (the first compiles); prints one JSON line (tokens/s of each, their ratio, whether the
data are identical) and appends it as a ``datagen`` record to ``--out``.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

from experiments.lib import toolkit

flags.DEFINE_integer("prompts", 64, "train-split questions")
flags.DEFINE_integer("rows", 32, "slots / batch rows")
flags.DEFINE_integer("max_new_tokens", 128, "tokens per continuation")
flags.DEFINE_string("out", "experiments/load_study/results/datagen.jsonl", "JSONL to write")
FLAGS = flags.FLAGS


def main(_):
    import jax
    from specjax import build, decoding, distill, models, sampling, specbench
    prov = toolkit.provenance("experiments.load_study.datagen")
    build.tune_xla_cpu()
    target, params = build.load_target("smollm2-135m-instruct", "float32", True)    # the trainer's layout
    tok = models.load_tokenizer("smollm2-135m-instruct")
    prompts = [decoding.encode_prompt(tok, q.turns[0]) for q in specbench.load(split="train")]
    prompts = [p for p in prompts if len(p) <= 512][: FLAGS.prompts]
    greedy = sampling.SamplingConfig.make(0.0)
    res = {}
    for slots in (True, False):
        kw = dict(key=jax.random.key(0), sampling=greedy, max_new_tokens=FLAGS.max_new_tokens, batch_size=FLAGS.rows,
                  eos_ids=tuple(tok.stop_token_ids), slots=slots)
        distill.generate(target, params, prompts, **kw)          # compiles every width and capacity
        t0 = time.perf_counter()
        data = distill.generate(target, params, prompts, **kw)
        dt = time.perf_counter() - t0
        new = sum(len(t) - p for t, p in zip(data.tokens, data.prompt_lengths))
        res["slots" if slots else "batches"] = {"seconds": dt, "new_tokens": int(new), "tokens_per_s": new / dt,
                                                "tokens": [t.tolist() for t in data.tokens]}
    same = sum(a == b for a, b in zip(res["slots"].pop("tokens"), res["batches"].pop("tokens")))
    rec = {"prompts": len(prompts), "rows": FLAGS.rows, "max_new_tokens": FLAGS.max_new_tokens, **res,
           "ratio_slots_over_batches": res["slots"]["tokens_per_s"] / res["batches"]["tokens_per_s"],
           "identical_sequences": same}
    out = toolkit.Jsonl(FLAGS.out, prov)
    out.write("datagen", **rec)
    out.close()
    print(json.dumps(rec))


if __name__ == "__main__":
    app.run(main)
