"""The data engine: prompts the target writes itself (Magpie), cleaned, and the target's answers.

Run: specjax data --config=configs/data.py --workdir=DIR   (the same command resumes)

Writes DIR/instructions, DIR/responses_greedy, DIR/responses_sampled, DIR/followups and
DIR/followup_responses (shards + manifest.json), DIR/corpus.jsonl with corpus_report.json, and
DIR/report.json + REPORT.md (counts, tokens, this run's throughput, the CPU).
"""

import ml_collections

from configs import generate


def get_config():
    c = ml_collections.ConfigDict()
    # The generator: target, layout and drafter exactly as configs/generate.py reads them;
    # drafter 'none' is target-only decoding. A drafter changes speed, never the data's
    # distribution (speculative sampling is exact).
    g = generate.get_config()
    g.drafter = "none"
    g.compare_target_only = False
    c.generate = g
    c.seed = 0
    c.batch_size = 64                      # rows per batch (cut where a batch's KV cache passes 4 GiB)
    c.shard_requests = 512                 # requests per shard: the unit of resumption
    c.pad_multiple = 64                    # prompt widths and cache capacities round up to this
    c.prefill_chunk = 128                  # prompt tokens per prefill call
    # > 0: slot refilling (`serving.generate_offline`): a row whose answer ends takes the next
    # request after at most this many rounds; 0: length-sorted batches that run to their longest
    # row (`decoding.generate_batched`)
    c.refill_rounds = 0
    c.spec_bench_train = True              # the Spec-Bench training split's first turns join the corpus
    c.spec_bench_per_category = 0          # at most this many of them per category (0 = all 360)
    # Magpie requests: seed task i % 12 steers request i (specjax.distill._corpus.SEED_TASKS); the
    # sampling settings of the requests (compared in experiments/data_engine/README.md)
    c.magpie = ml_collections.ConfigDict(dict(requests=6000, temperature=0.7, top_p=0.9, max_new_tokens=160))
    # Answers to every corpus prompt: greedy, and (sampled=True) once more at temperature / top_p
    c.responses = ml_collections.ConfigDict(dict(sampled=True, temperature=1.0, top_p=0.95, max_new_tokens=512))
    # Follow-up turns on the first `requests` greedy answers, and the greedy answers to them
    c.followup = ml_collections.ConfigDict(dict(
        requests=2000, temperature=1.0, top_p=1.0, max_new_tokens=96,
        response=ml_collections.ConfigDict(dict(temperature=0.0, top_p=1.0, max_new_tokens=512))))
    # Texts that must not leak into the corpus besides the held-out Spec-Bench questions (always
    # banned): a JSONL file of {"turns": [...]} or {"text": ...} records; "" = none.
    c.eval_prompts = ""
    # a stage stops (keeping its shards) when more than this fraction of its requests end other
    # than by EOS or max_new_tokens (e.g. nan_logits); such rows are never training data
    c.max_dropped_fraction = 0.05
    return c
