"""Settings of the temperature sweep (`python -m experiments.temperature.run --config=<this file>[:tiny]`).

A variant of the token-tree benchmark (`experiments/bench_trees`): prompt lookup and the
shipped distilled draft at gamma 2 against target-only
decoding at temperatures 0, 0.5, 1.0, 1.5 and at temperature 1 with top-p 0.9, batch 1, the
shortest held-out Spec-Bench question of each of the 13 categories (the same prompts and
per-request keys in every setting). The same logits processing is applied to draft and target.
Variant "tiny": the benchmark's random 4-layer target (seconds; CI).
"""

from experiments.lib import tree_config as trees_config


def get_config(variant: str = ""):
    c = trees_config.get_config("tiny" if variant == "tiny" else "")
    c.drafters = ("ngram", "distilled")     # ~21 minutes on 2 cores (the EAGLE-3 head would add ~10)
    c.chains = (2,)
    c.head_chains = (2,)
    c.ngram_trees, c.model_trees, c.head_trees = (), (), ()
    c.samplings = ("0", "0.5", "1", "1.5", "1:0.9")
    c.node_counts = (1, 3)
    c.out = "experiments/temperature/results/results.jsonl"
    if variant == "tiny":
        c.update(drafters=("early_exit",), samplings=("0", "1:0.9"), out="/tmp/temperature/results.jsonl")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '' or 'tiny'")
    return c
