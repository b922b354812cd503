"""Settings of the Spec-Bench table (`python -m experiments.spec_bench.run --config=<this file>[:tiny]`).

`specjax bench` (configs/bench.py: the main command's settings, adaptive gamma) with every
drafter on the default target: prompt lookup, the shipped distilled draft and the shipped EAGLE-3
head, against target-only decoding of the same prompts in the same run; the first
held-out question (file order) of each of the 13 Spec-Bench categories, batch 1, greedy, 64 new
tokens. Variant "tiny": two drafters, 3 prompts, 8 tokens, for a tiny target given as
--config.target (tests/test_spec_bench.py writes one; CI).
"""

import ml_collections  # noqa: F401  (the config is an ml_collections ConfigDict)

from configs import bench


def get_config(variant: str = ""):
    c = bench.get_config()
    c.drafters = ("ngram", "distilled", "head:experiments/heads/eagle3")
    c.per_category = 1
    c.max_new_tokens = 64
    c.calibration_cache = ""                # calibrated in the run (recorded), not from a cache
    c.out = "experiments/spec_bench/results"
    c.progress = False
    if variant == "tiny":
        c.update(drafters=("ngram", "early_exit"), per_category=1, num_prompts=3, max_new_tokens=8,
                 early_exit_layers=1, cpu_kernel="off", compilation_cache_dir="", out="/tmp/spec_bench")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '' or 'tiny'")
    return c
