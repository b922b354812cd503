"""`specjax eval`: a draft's teacher-forced acceptance against its target (no wall-clock).

Run: specjax eval --config=configs/eval.py [--config.drafter=model --config.draft_model=DIR]

On the target's greedy continuations of the held-out Spec-Bench prompts (`eval.per_category`
per category, `eval.max_new_tokens` tokens each; generated once and cached under `data_root`),
or on a fixed JSONL set (`eval.data_jsonl`): alpha = E[sum_x min(p(x), q(x))] at temperature 1,
greedy agreement (argmax q = argmax p) and the greedy committed tokens per target pass at each
gamma in `gammas` (an exact simulation from the agreement; `specjax.distill.evaluate`).
The data settings are configs/distill.py's, so the numbers match the trainer's evaluations.
"""

from configs import distill


def get_config():
    c = distill.get_config()
    for key in ("draft", "loss", "optim", "budget_tokens", "checkpoint_every", "keep_checkpoints",
                "async_checkpoints", "export_dir", "export_dtype"):
        del c[key]                      # training settings; eval reads the target, data and eval keys
    for key in ("greedy_samples", "sampled_samples", "temperature", "max_new_tokens", "max_prompt_tokens", "per_category",
                "fixed_jsonl", "target_weight", "fixed_weight", "draft_weight", "draft_refresh_every",
                "draft_prompts", "draft_max_prompt_tokens", "draft_max_new_tokens"):
        del c.data[key]                 # training data; eval keeps the buckets and batch sizes
    for key in ("every", "at_start", "gamma"):
        del c.eval[key]
    # 'distilled' (a draft directory from specjax distill; "" = the one shipped for the target),
    # 'model' (any checkpoint of the target's vocabulary), 'early_exit' (the target's first
    # early_exit_layers layers and its head).
    c.drafter = "distilled"
    c.draft_model = ""
    c.early_exit_layers = 4
    c.gammas = (1, 2, 3, 4, 5)
    c.out = ""                          # also append the result as one JSON line to this file
    return c
