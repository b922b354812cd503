"""The distillation study's training run (experiments/distill_study; issue 16): configs/distill.py
at a budget and a prompt set that let 24 runs (4 divergences x 3 data sources x 2 seeds) finish
in about half an hour on a 2-core CPU.

Run one: python -m specjax.distill --config=configs/distill_study.py --workdir=/tmp/study \
             --config.loss.divergence=rkl --config.data.target_weight=0.5 --config.data.draft_weight=0.5

The draft is the shipped recipe's (the target's layers 0-2, a reduced head over the 8,192 most
frequent continuation tokens, the target's rows: identical at the start of every run). Data: the
first 6 train prompts of each Spec-Bench category among those of at most 192 chat-templated
tokens (summarization and RAG questions are all longer; extraction has one); the target's
greedy continuations of them (128 new tokens) and/or the draft's own temperature-1
continuations of 16 of them, drawn afresh from the current draft every 8 steps (on-policy).
Which sources and weights, the divergence and the seed are set per run by the study.
"""

from configs import distill


def get_config():
    c = distill.get_config()
    c.budget_tokens = 8_000                  # loss tokens per run, whatever their source (~16 steps)
    c.data.per_category = 6                  # train prompts per category (<= max_prompt_tokens)
    c.data.max_prompt_tokens = 192
    c.data.max_new_tokens = 128
    c.data.widths = (320,)                  # 192 + 128: every sequence in one bucket
    c.data.tokens_per_batch = 1280          # 4 rows of 320: ~500 loss tokens a step
    c.data.target_weight = 1.0
    c.data.draft_weight = 0.0
    c.data.draft_prompts = 16                # per on-policy refresh (four batches)
    c.data.draft_refresh_every = 8           # steps (on-policy alone: each refresh is seen twice)
    c.data.draft_max_prompt_tokens = 192
    c.data.draft_max_new_tokens = 128
    c.data.gen_batch_size = 16               # a refresh's 16 prompts in one batch (no padding rows)
    c.optim.learning_rate = 1e-3
    c.optim.warmup_steps = 3
    c.checkpoint_every = 1000                # a run is short: its checkpoint is the final one
    c.keep_checkpoints = 1
    c.eval.every = 1000                      # held-out alpha at the end of the run
    c.eval.max_prompt_tokens = 192           # held-out prompts of the training prompts' kind: 4 per category
    c.eval.at_start = False                  # the start is the same draft in every run: evaluated once by the study
    c.progress = False
    return c
