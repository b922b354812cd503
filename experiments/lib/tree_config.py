"""Settings of the token-tree benchmark (`python -m experiments.bench_trees.run --config=<this file>[:tiny]`).

Chain vs static tree vs dynamic tree, per drafter, on held-out Spec-Bench prompts at batch 1,
greedy and T = 1, target-only decoding in the same run, and the cost of one target pass that
scores N tokens (a tree block of N - 1 nodes) for N = 1..64. The target, dtype, layer layout
and drafter settings come from the production configuration (`configs/generate.py`).
Variant "tiny": a random 4-layer target (seconds; CI).
"""

import ml_collections


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    c.generate_config = "configs/generate.py"
    c.workload = ""                         # "" = the generate config's target; preset:<size> = random weights
    c.num_prompts = 120                     # held-out questions read (all); the shortest of each category runs
    c.prompt_len = 0
    c.max_new_tokens = 64
    c.temperatures = (0.0, 1.0)
    c.samplings = ()                        # "T" or "T:top_p" strings; replaces temperatures when given
    c.per_category = 1                      # the k shortest held-out questions of each category
    c.adaptive = False                      # also AdaptiveGamma over (0,) + chains, calibrated per drafter
    c.draft_costs = False                   # time one propose of gamma tokens per drafter and chain
    c.drafters = ("ngram", "early_exit", "distilled")
    c.early_exit_layers = 0                 # 0 = the generate config's
    c.chains = (1, 2, 4)                    # gamma of the linear drafts
    # Static trees per drafter kind (`specjax.trees.parse_tree`); the n-gram drafter drafts k chains.
    c.ngram_trees = ("branching:3,1,1,1",)
    c.model_trees = ("branching:2,2,1", "dynamic:4,3,12", "dynamic:5,4,20")
    c.tree_verifier = "traversal"           # sampled trees (T > 0); greedy uses the greedy tree verifier
    c.tree_children = "iid"
    c.verifiers = ()                        # e.g. ('token', 'block'): each chain once per verifier
    c.tree_verifiers = ()                   # e.g. ('traversal', 'recursive'): each tree once per verifier
    c.node_counts = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)   # tokens scored in one pass
    c.cost_iters = 20
    c.pad_multiple = 64
    c.init_std = 0.2
    c.seed = 0
    c.out = "experiments/bench_trees/results/results.jsonl"
    if variant == "tiny":
        c.update(workload="preset:tiny", num_prompts=2, prompt_len=16, max_new_tokens=16, temperatures=(0.0, 1.0),
                 drafters=("ngram", "early_exit"), early_exit_layers=2, chains=(2,), ngram_trees=("branching:2,1",),
                 model_trees=("branching:2,1", "dynamic:2,2,3"), node_counts=(1, 2, 4), cost_iters=2,
                 pad_multiple=32, out="/tmp/bench_trees/results.jsonl")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '' or 'tiny'")
    return c
