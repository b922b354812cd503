"""Settings of the distillation study (`python -m experiments.distill_study.run --config=<this file>[:tiny]`).

DistillSpec's question (Zhou et al., ICLR 2024, sections 3-5) on the default target: how much
does one draft's held-out acceptance rise at a fixed budget of loss tokens, per divergence
(FKL, RKL, JSD(beta = 0.5), TVD) and per data source: the target's own greedy continuations
(``target``), the draft's own temperature-1 continuations redrawn from the current draft during
training (``on-policy``), or half of each (``mixed``); each with two seeds (batch order, the
on-policy samples). Every run starts from the same draft and trains under `training_config`
with only those keys changed. Variant "tiny": a tiny target given by ``target`` (a Hugging Face
directory with a tokenizer), seconds per run (CI).
"""

import pathlib

import ml_collections

# data source -> the training config's mixture weights
SOURCES = {
    "target": {"data.target_weight": 1.0, "data.draft_weight": 0.0},
    "on-policy": {"data.target_weight": 0.0, "data.draft_weight": 1.0},
    "mixed": {"data.target_weight": 0.5, "data.draft_weight": 0.5},
}


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    c.training_config = "configs/distill_study.py"
    c.target = ""                           # "" = the training config's
    c.divergences = ("fkl", "rkl", "jsd", "tvd")
    c.sources = tuple(SOURCES)
    c.seeds = (0, 1)
    c.runs = str(pathlib.Path.home() / ".cache" / "specjax" / "distill_study")   # workdirs (finished runs reused)
    c.data_root = ""                        # "" = the trainer's cache (~/.cache/specjax/distill)
    c.compilation_cache_dir = "~/.cache/specjax/xla"   # 24 runs compile the same programs: one compile each
    c.overrides = ml_collections.ConfigDict()          # training-config keys set in every run (nested as there)
    c.out = "experiments/distill_study/results/results.jsonl"
    if variant == "tiny":
        c.update(seeds=(0, 1), divergences=("fkl",), runs="/tmp/distill_study/runs",
                 data_root="/tmp/distill_study/data", compilation_cache_dir="", out="/tmp/distill_study/results.jsonl")
        # Prompts of at most 96 tokens (10 train prompts, every sequence in one 128-token bucket: 4 rows
        # a step) and held-out prompts of at most 49 (4 of them, one batch: the evaluation's full-vocabulary
        # work is most of a tiny run's time). Generation in batches of 4 rows: the held-out prompts' batch
        # is the same program as the train prompts' (4 + 4 + 2), and a refresh's 4 prompts are one batch.
        c.overrides = ml_collections.ConfigDict(dict(
            budget_tokens=600, export_dtype="float32",
            data=dict(per_category=1, max_prompt_tokens=96, max_new_tokens=16, widths=(128,), tokens_per_batch=512,
                      gen_batch_size=4, draft_prompts=4, draft_refresh_every=4, draft_max_prompt_tokens=96,
                      draft_max_new_tokens=16),
            draft=dict(layers=(0,), head_vocab=256), eval=dict(per_category=1, max_prompt_tokens=49, max_new_tokens=16),
            optim=dict(learning_rate=3e-3)))
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: expected '' or 'tiny'")
    return c
