"""Settings of the draft-head benchmark (issue 14), a variant of the token-tree benchmark:

    python -m experiments.bench_trees.run --config=experiments/heads/config.py

Held-out Spec-Bench prompts (the shortest question of each of the 13 categories), batch 1,
greedy and T = 1, target-only decoding in the same run: the shipped 3-layer distilled draft
against the feature heads trained by `experiments/heads/train.py` (chains, and for the EAGLE
heads static and EAGLE-2 dynamic trees from the head's own confidences; a head drafts from the
target's features, see `specjax.drafters`), and the cost of one target pass scoring N tokens.
"""

from experiments.lib import tree_config as trees_config

HEADS = ("eagle3", "eagle", "medusa")


def head_dir(kind: str) -> str:
    return f"experiments/heads/{kind}"


def get_config(variant: str = ""):
    c = trees_config.get_config()
    c.drafters = ("distilled",) + tuple(f"head:{head_dir(k)}" for k in HEADS)
    c.chains = (1, 2)                       # the distilled draft's chains (its best gamma is <= 2)
    c.head_chains = (1, 2, 3)
    c.head_trees = ("branching:2,2,1", "dynamic:4,3,12", "dynamic:5,4,20")   # EAGLE heads (EAGLE-2 trees)
    c.model_trees = ()
    c.node_counts = (1, 2, 3, 4, 5, 6, 8)
    c.out = "experiments/heads/results/results.jsonl"
    if variant.startswith("only:"):         # e.g. only:eagle3 (the heads that exist)
        kinds = tuple(variant.split(":", 1)[1].split(","))
        c.drafters = ("distilled",) + tuple(f"head:{head_dir(k)}" for k in kinds)
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '' or 'only:<kind>[,<kind>..]'")
    return c
