"""Settings of the greedy exactness check (`python -m experiments.greedy_exactness.run --config=<this file>[:tiny]`).

The target, its dtype and layer layout and the drafters' settings come from the production
configuration (`configs/generate.py`: unrolled layers, fused projections); this file picks the
prompts, lengths, batch sizes and drafters. Variant "tiny": a random 4-layer target (seconds).
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
    c.out = "experiments/greedy_exactness/results.jsonl"
    if variant == "tiny":
        c.update(workload="preset:tiny", num_prompts=4, prompt_len=16, max_new_tokens=24, batch_sizes=(1, 2),
                 early_exit_layers=2, pad_multiple=32, out="/tmp/greedy_exactness/results.jsonl")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '' or 'tiny'")
    return c


def drafter_specs(c) -> list[tuple[str, int]]:
    """[(kind, gamma)] of ``c.drafters`` ("kind:gamma"); ValueError naming the setting for a bad one."""
    from specjax.build import DRAFTER_KINDS

    kinds = [k for k in DRAFTER_KINDS if k != "none"]
    out = []
    for spec in c.drafters:
        kind, _, gamma = spec.partition(":")
        if kind not in kinds or not gamma.isdigit() or int(gamma) < 1:
            raise ValueError(f"config.drafters: {spec!r} is not kind:gamma with kind in {kinds} and gamma >= 1")
        out.append((kind, int(gamma)))
    return out
