"""Settings of the heads' learning curve (`python -m experiments.learning_curve.run --config=<this file>[:fixed|:tiny]`).

Each point trains one head kind on the first `size` loss tokens of the data engine's answer
shards (nested prefixes, `specjax.distill.ShardStream`) for the same budget as the other kinds
at that size, from configs/distill_head.py, and evaluates it on the held-out Spec-Bench
continuations at the end. Variant "fixed": EAGLE at one budget for every size (series
"fixed-2.2M"), so that only the data varies. Variant "bf16": the 150k point of both kinds with
the head computed in bfloat16. Variant "long": both kinds on all answer tokens for 20M training
tokens each (issue 55 item 4), batches grouped by answer length. Variant "tiny": the CI check of the same path (tests/test_learning_curve.py
passes a toy target, shards and evaluation set through `set`).
"""

import ml_collections

from experiments.lib import engine_data


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    # Answer stages of `specjax data` to the corpus's first turns, greedy and sampled (the
    # user-turn stages, instructions and followups, are not the target's answers; the answers to
    # follow-up turns are left to the shipped head, so the curve's nested sizes are fixed once
    # these two stages are complete).
    c.shard_dirs = engine_data.stage_dirs("responses_greedy", "responses_sampled")
    c.sizes = (60_000, 150_000, 400_000, 1_000_000, 2_200_000)   # loss tokens of data per point (log-spaced)
    c.kinds = ("eagle", "eagle3")
    c.feature_kinds = ("eagle", "eagle3")   # kinds whose layers each size's feature cache holds (filled in one
                                         # target pass per shard, whichever kinds this run trains)
    # Per-kind settings over configs/distill_head.py: EAGLE with input norms and the feature
    # regression, EAGLE-3 with a training-time test of 7 steps.
    c.kind_overrides = ml_collections.ConfigDict({
        "eagle": {"head": {"ttt_steps": 1, "feature_weight": 1.0, "input_norm": True}},
        "eagle3": {"head": {"ttt_steps": 7, "input_norm": True}},
        # the parallel block drafter: EAGLE-3's layers and input norms, a block of 4 positions
        # (trained like a 4-step training-time test)
        "parallel": {"head": {"ttt_steps": 1, "num_heads": 4, "input_norm": True}},
    })
    # Training tokens per point: epochs x size, clipped to [min_budget, max_budget]; the same
    # for every kind at a size.
    c.epochs = 1.0
    c.min_budget = 300_000
    c.max_budget = 2_200_000
    # Sequence buckets of the batches (() = configs/distill_head.py's; `engine_data.WIDTHS`: finer,
    # so a step spends more of its positions on loss tokens)
    c.widths = engine_data.WIDTHS
    c.window = engine_data.WINDOW        # shards shuffled together
    c.eval_gamma = 5                     # simulated chains gamma = 1..eval_gamma
    c.workdir = "/tmp/specjax-learning-curve"   # one resumable training workdir per point
    c.out = "experiments/heads/results/learning_curve.jsonl"
    # Overrides of every point's training config (nested, as in configs/distill.py), applied last:
    # checkpoints every 25 steps (~51k training tokens), so a point cut off with its session loses
    # little when the same command resumes it.
    c.set = ml_collections.ConfigDict({"checkpoint_every": 25})
    c.progress = True
    # A name for points made under other budget settings than the one-pass curve's (records,
    # workdirs and the report keep the series apart); "" = the main curve.
    c.series = ""
    if variant == "fixed":
        # Data alone varied: every size trained for the same 2.2M tokens (several passes over the
        # small sizes), EAGLE only (the cheap kind on cached features).
        c.kinds = ("eagle",)
        c.min_budget = c.max_budget = 2_200_000
        c.series = "fixed-2.2M"
    elif variant == "bf16":
        # The head's forward and backward in bfloat16 (`head.compute_dtype`), at the main curve's
        # 150k point of both kinds, to set against its float32 points (speed and held-out figures).
        c.kinds = ("parallel", "eagle3")
        c.sizes = (150_000,)
        c.set.head = ml_collections.ConfigDict({"compute_dtype": "bfloat16"})
        c.series = "bf16"
    elif variant == "long":
        # Issue 55 item 4: both kinds on every answer stage of the corpus (first turns greedy and
        # sampled, follow-up answers: all their loss tokens) for 20M training tokens each, with a
        # held-out evaluation every ~2.5M training tokens (the curve against training tokens; the
        # learning rate decays over the whole 20M, so the early evaluations are of a run still at
        # a high rate, not of runs sized for those budgets). Features cached in float16 (the
        # corpus's 5.5M positions: ~22 GB).
        c.shard_dirs = engine_data.stage_dirs("responses_greedy", "responses_sampled", "followup_responses")
        c.kinds = ("parallel", "eagle3")
        c.feature_kinds = ()
        c.sizes = (10 ** 9,)                   # more than there is: every loss token
        c.min_budget = c.max_budget = 20_000_000
        c.set.update({"eval": {"every": 1221}, "head": {"feature_cache": "float16"}, "checkpoint_every": 50,
                      "data": {"shards": {"group_by_length": True}}})
        c.series = "20M"
    elif variant == "tiny":
        c.sizes = (300, 900)
        c.kind_overrides.eagle3.head.ttt_steps = 2
        c.epochs, c.min_budget, c.max_budget = 2.0, 600, 2000
        c.widths = ()
        c.window, c.eval_gamma, c.progress = 2, 2, False
        c.out = "/tmp/specjax-learning-curve-tiny/learning_curve.jsonl"
        c.workdir = "/tmp/specjax-learning-curve-tiny/work"
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '', 'fixed', 'bf16', 'long' or 'tiny'")
    return c
