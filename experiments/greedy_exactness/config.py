"""Settings of the greedy exactness check (`python -m experiments.greedy_exactness.run --config=<this file>[:tiny]`).

The target, its dtype and layer layout and the drafters' settings come from the production
configuration (`configs/generate.py`: unrolled layers, fused projections); this file picks the
prompts, lengths, batch sizes and drafters. Variant "tiny": a random 4-layer target (seconds). Variant "trees": token-tree speculation
(static trees for the n-gram and early-exit drafters, an EAGLE-2 dynamic tree for the distilled
draft), written to results_trees.jsonl. Variant "current": what the main command and the studies
run today (the hybrid default, the shipped head in a chain and in a dynamic tree, the n-gram and
the distilled draft in trees), batch 1, written to results_current.jsonl. Variant "bf16": the TPU
profile (configs/generate_tpu.py: bfloat16, one block shape for every target pass) with the
hybrid, the head chain and the head dynamic tree, no near-tie excuse, to results_bf16.jsonl.
Variant "parallel": the parallel block drafter (``parallel_model``) in a chain and a dynamic
tree, batch 1, to results_parallel.jsonl. Variant "suffix_hybrid": the hybrid with suffix decoding
as its lookup half, batch 1, to results_suffix_hybrid.jsonl.
"""

import ml_collections


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    c.generate_config = "configs/generate.py"   # target, dtype, layers, early_exit_layers, max_ngram, draft_model
    c.workload = ""                             # "" = the generate config's target; preset:<size> = random weights
    c.num_prompts = 48                          # held-out Spec-Bench questions, round-robin over the categories
    c.prompt_len = 0                            # presets only (0: 12..47 random ids)
    c.max_new_tokens = 128
    c.batch_sizes = (1, 4)
    c.drafters = ("ngram:4", "early_exit:4", "distilled:4")   # kind:gamma
    c.early_exit_layers = 0                     # 0 = the generate config's
    c.pad_multiple = 128
    c.init_std = 0.2                            # presets' random weights
    c.seed = 0
    # a mismatch is a near-tie (reported, teacher-forced) where the target's top-2 logit gap is
    # below this; -1 = decoding.NEAR_TIE_EPS; 0 = no near-tie excuse (every mismatch fails)
    c.near_tie_eps = -1.0
    c.parallel_model = ""                       # the parallel drafter's directory (drafters 'parallel:...')
    # drafting settings of the generate config's keys for every drafter of the run, e.g.
    # {'hybrid_lookup': 'suffix'} (the suffix-hybrid)
    c.drafter_settings = ml_collections.ConfigDict()
    c.out = "experiments/greedy_exactness/results.jsonl"
    if variant == "tiny":
        c.update(workload="preset:tiny", num_prompts=4, prompt_len=16, max_new_tokens=24, batch_sizes=(1, 2),
                 early_exit_layers=2, pad_multiple=32, out="/tmp/greedy_exactness/results.jsonl")
    elif variant == "trees":
        c.update(drafters=("ngram:branching:3,1,1,1", "early_exit:branching:2,2,1", "distilled:dynamic:4,3,12"),
                 out="experiments/greedy_exactness/results_trees.jsonl")
    elif variant == "current":
        c.update(drafters=("hybrid:3", "head:3", "head:dynamic:4,3,12", "ngram:branching:3,1,1,1",
                           "distilled:dynamic:4,3,12"), batch_sizes=(1,),
                 out="experiments/greedy_exactness/results_current.jsonl")
    elif variant == "bf16":
        # the accelerator profile in bfloat16 (one block shape for every target pass) on the
        # real target, no near-tie excuse: the drafters the main command and the studies run
        c.update(generate_config="configs/generate_tpu.py", near_tie_eps=0.0,
                 drafters=("hybrid:3", "head:3", "head:dynamic:4,3,12"),
                 out="experiments/greedy_exactness/results_bf16.jsonl")
    elif variant == "parallel":
        # the parallel block drafter in a chain of 4 and a dynamic tree over its block, batch 1
        c.update(drafters=("parallel:4", "parallel:dynamic:4,4,12"), batch_sizes=(1,),
                 parallel_model="experiments/heads/parallel", out="experiments/greedy_exactness/results_parallel.jsonl")
    elif variant == "suffix_hybrid":
        # the suffix-hybrid (suffix decoding where the context matches, the shipped head elsewhere), batch 1
        c.update(drafters=("hybrid:3",), batch_sizes=(1,), out="experiments/greedy_exactness/results_suffix_hybrid.jsonl")
        c.drafter_settings = ml_collections.ConfigDict({"hybrid_lookup": "suffix"})
    elif variant == "tiny_trees":
        c.update(workload="preset:tiny", num_prompts=4, prompt_len=16, max_new_tokens=24, batch_sizes=(1, 2),
                 early_exit_layers=2, pad_multiple=32, out="/tmp/greedy_exactness/results_trees.jsonl",
                 drafters=("ngram:branching:3,1,1", "early_exit:branching:2,2", "early_exit:dynamic:3,2,5"))
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '', 'tiny', 'trees', 'current', 'bf16', 'parallel', "
                         f"'suffix_hybrid' or 'tiny_trees'")
    return c


def drafter_specs(c) -> list[tuple[str, object]]:
    """[(kind, gamma, tree or policy)] of ``c.drafters`` ("kind:gamma", "kind:<tree>", the tree as
    `specjax.trees.parse_tree` reads it, e.g. "early_exit:branching:2,2,1", or "kind:budget:G,W":
    every round a row budget, `specjax.RowBudget(G, W)`, the rows' gammas 0..G in one packed
    pass); ValueError naming the setting for a bad one."""
    from specjax import decoding, trees
    from specjax import drafters

    kinds = [k for k in drafters.drafter_kinds() if k != drafters.TARGET_ONLY]
    out = []
    for spec in c.drafters:
        kind, _, rest = spec.partition(":")
        if kind in kinds and rest.isdigit() and int(rest) >= 1:
            out.append((kind, int(rest)))
            continue
        if kind in kinds and rest.startswith("budget:"):
            try:
                g, w = rest[len("budget:"):].split(",")
                out.append((kind, decoding.AdaptiveGamma(gammas=(decoding.RowBudget(int(g), float(w)),))))
            except ValueError as e:
                raise ValueError(f"config.drafters: {spec!r} is not kind:budget:G,W (a row budget: gamma G >= 1, "
                                 f"W positions per row, 1 < W <= G + 1): {e}") from None
            continue
        try:
            tree = trees.parse_tree(rest)
        except ValueError:
            tree = None
        if kind not in kinds or tree is None:
            raise ValueError(f"config.drafters: {spec!r} is not kind:gamma (gamma >= 1) or kind:<tree> "
                             f"(e.g. early_exit:branching:2,2,1) with kind in {kinds}")
        out.append((kind, tree))
    return out
