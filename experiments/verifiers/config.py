"""Settings of the verifier comparison (`python -m experiments.verifiers.run --config=<this file>[:tiny]`).

A variant of the token-tree benchmark (`experiments/bench_trees`) at temperature 1: the same
drafts verified by the token verifier (Leviathan et al. 2023) and block verification (Sun et al.
2025) for chains, and by SpecInfer's recursive rejection sampling (Miao et al. 2024) and
Traversal Verification (Weng et al. 2025) for token trees; the shipped distilled draft (chain
gamma 3, static tree 2,2,1), on
the shortest held-out Spec-Bench question of each category, batch 1, the same per-request keys
for every verifier. Variant "tiny": the benchmark's random target (seconds; CI).
"""

from experiments.lib import tree_config as trees_config


def get_config(variant: str = ""):
    c = trees_config.get_config("tiny" if variant == "tiny" else "")
    c.drafters = ("distilled",)
    c.chains = (3,)
    c.model_trees = ("branching:2,2,1",)
    c.ngram_trees = ()
    c.verifiers = ("token", "block")
    c.tree_verifiers = ("traversal", "recursive")
    c.temperatures = (1.0,)
    c.node_counts = (1, 4, 8)
    c.out = "experiments/verifiers/results/results.jsonl"
    if variant == "tiny":
        c.update(drafters=("early_exit",), chains=(2,), model_trees=("branching:2,1",), node_counts=(1, 2),
                 out="/tmp/verifiers/results.jsonl")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '' or 'tiny'")
    return c
