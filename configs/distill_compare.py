"""The divergence comparison: configs/distill.py with a 100k-token budget on the target's
greedy data only (no on-policy data, so the runs differ only in loss.divergence).

Run: python -m experiments.distill.run --stage compare   (one run per divergence)
"""

from configs import distill


def get_config():
    c = distill.get_config()
    c.budget_tokens = 100_000
    c.data.target_weight = 1.0
    c.data.draft_weight = 0.0
    c.optim.learning_rate = 5e-4   # the comparison's rate (committed results); the recipe uses 1e-3
    c.optim.warmup_steps = 10
    c.eval.every = 10**9       # evaluated once, at the end (the start is the recipe's step-0 evaluation)
    c.eval.at_start = False
    return c
