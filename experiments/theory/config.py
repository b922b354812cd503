"""Settings of the theory-vs-measurement study and the gamma sweep (one run serves both):

    python -m experiments.theory.run --config=experiments/theory/config.py[:tiny]

A variant of the token-tree benchmark (`experiments/bench_trees`): chains of gamma 1..3 and
adaptive drafting (gamma per round among 0..3, round times calibrated per drafter) for every
drafter on the default target (prompt lookup, early exit, the shipped distilled draft, the
shipped EAGLE-3 head), batch 1, the shortest held-out Spec-Bench question of
each of the 13 categories, greedy (~28 minutes on 2 cores); the cost of one target pass of N = 1..4 tokens and of one draft
proposal of gamma tokens (c of Leviathan et al. 2023) measured in the same run.
Variant "tiny": the benchmark's random 4-layer target (seconds; CI).
"""

from experiments.lib import tree_config as trees_config


def get_config(variant: str = ""):
    c = trees_config.get_config("tiny" if variant == "tiny" else "")
    c.drafters = ("ngram", "early_exit", "distilled", "head:experiments/heads/eagle3")
    c.chains = (1, 2, 3)
    c.head_chains = (1, 2, 3)
    c.ngram_trees, c.model_trees, c.head_trees = (), (), ()
    c.adaptive = True
    c.draft_costs = True
    c.temperatures = (0.0,)                 # T = 1: experiments/temperature (a run of both is ~55 min here)
    c.node_counts = (1, 2, 3, 4)
    c.out = "experiments/theory/results/results.jsonl"
    if variant == "tiny":
        c.update(drafters=("ngram",), chains=(1, 2), head_chains=(1, 2), node_counts=(1, 2, 3),
                 out="/tmp/theory/results.jsonl")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '' or 'tiny'")
    return c
