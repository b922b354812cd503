"""Slot refilling against length-sorted batches for the data engine's answers, in one run.

    python -m experiments.data_engine.refill [--prompts=128] [--batch=64] [--rounds=16] [--out=FILE]

The first `prompts` prompts of the cleaned corpus (experiments/data_engine/corpus/corpus.jsonl)
in the target's chat template, answered greedily with up to 512 new tokens (the
responses_greedy stage's settings), target-only, through both paths the data command has:
`decoding.generate_batched` (length-sorted batches of `batch` rows that run to their longest
answer) and `serving.generate_offline` (`batch` slots refilled every `rounds` rounds). Wall
time per path includes compilation, as a data-engine run pays it; one JSON record per path plus
a comparison (tokens/s ratio, sequences equal between the paths) is appended to `out`, with the
CPU model.
"""

from __future__ import annotations

import json
import pathlib
import time

from absl import app, flags

from experiments.lib import toolkit

PROMPTS = flags.DEFINE_integer("prompts", 128, "corpus prompts answered by each path")
BATCH = flags.DEFINE_integer("batch", 64, "rows per batch / slots")
ROUNDS = flags.DEFINE_integer("rounds", 16, "rounds per host round trip when refilling")
MAX_NEW = flags.DEFINE_integer("max_new_tokens", 512, "new tokens per answer at most")
OUT = flags.DEFINE_string("out", "experiments/data_engine/results/refill.jsonl", "JSONL file appended to")


def main(argv):
    del argv
    import jax

    from configs import data as data_config
    from specjax import build, decoding, sampling, serving

    build.tune_xla_cpu()                  # as the CLI does, before any backend starts
    c = data_config.get_config()
    gen = build.load_generator(build.generate_settings(c.generate))
    texts = [json.loads(line)["text"] for line in
             pathlib.Path("experiments/data_engine/corpus/corpus.jsonl").read_text().splitlines()[:PROMPTS.value]]
    prompts = [list(gen.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                      tokenize=True)) for t in texts]
    engine = decoding.Engine(gen.engine.target, None, decoding.GenerationConfig(
        max_new_tokens=MAX_NEW.value, gamma=0, eos_ids=tuple(gen.config.eos_ids), prefill_chunk=c.prefill_chunk))
    params = decoding.EngineParams(target=gen.params.target)
    greedy = sampling.SamplingConfig.make(temperature=0.0)
    key = jax.random.key(0)
    prov = toolkit.provenance("experiments.data_engine.refill", with_backend=False,
                              config={"prompts": PROMPTS.value, "batch": BATCH.value, "rounds": ROUNDS.value,
                                      "max_new_tokens": MAX_NEW.value})
    ids = list(range(len(prompts)))
    outs, recs = {}, []
    for path in ("batched", "refill"):
        t0 = time.perf_counter()
        if path == "batched":
            toks = {}
            for results, _ in decoding.generate_batched(engine, params, prompts, greedy, key, batch_size=BATCH.value,
                                                         pad_multiple=c.pad_multiple, request_ids=ids):
                toks.update((r.index, r.tokens) for r in results)
        else:
            toks = serving.generate_offline(engine, params, prompts, greedy, key, request_ids=ids, slots=BATCH.value,
                                            pad_multiple=c.pad_multiple, rounds_per_sync=ROUNDS.value)
        wall = time.perf_counter() - t0
        new = sum(len(t) for t in toks.values())
        outs[path] = toks
        rec = {"kind": "path", "path": path, "prompts": len(prompts), "new_tokens": new, "wall_s": wall,
               "tokens_per_s": new / wall, "provenance": prov}
        recs.append(rec)
        print(f"{path}: {new} new tokens in {wall:.0f} s = {new / wall:.1f} tokens/s (compilation included)",
              flush=True)
    same = sum(outs["batched"][i] == outs["refill"][i] for i in ids)
    ratio = recs[1]["tokens_per_s"] / recs[0]["tokens_per_s"]
    recs.append({"kind": "comparison", "refill_over_batched": ratio, "same_sequences": same, "prompts": len(ids),
                 "provenance": prov})
    print(f"refill / batched: {ratio:.2f}x; {same} of {len(ids)} answers identical", flush=True)
    out = pathlib.Path(OUT.value)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    app.run(main)
