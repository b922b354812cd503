"""Settings of the CPU levers study (`python -m experiments.cpu_levers.run --config=<this file>[:tiny]`).

bfloat16 against float32, and the two host CPU devices as a model-parallel mesh against one
device, for the default target on this CPU: the cost of a k-token target forward (k = 1..16),
target-only greedy decoding tokens/s and prompt-lookup speculative tokens/s on held-out
Spec-Bench prompts, all in one run (each variant in its own process: the device count is fixed
when a process starts). Variant "tiny": a random small target, a few seconds per variant (CI).
"""

import ml_collections

# name -> (dtype, cpu_kernel, host devices)
VARIANTS = {
    "float32 kernel, 1 device": ("float32", "on", 1),
    "float32 XLA, 1 device": ("float32", "off", 1),
    "bfloat16 XLA, 1 device": ("bfloat16", "off", 1),
    "float32 XLA, mesh model=2": ("float32", "off", 2),
    "bfloat16 XLA, mesh model=2": ("bfloat16", "off", 2),
}


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    c.generate_config = "configs/generate.py"
    c.target = ""                           # "" = the generate config's target
    c.variants = tuple(VARIANTS)
    c.ks = (1, 2, 3, 4, 5, 8, 12, 16)       # tokens per target forward
    c.ctx = 256                             # tokens already in the cache for the k-token probes
    c.cost_iters = 20
    c.num_prompts = 6                       # shortest held-out questions of the first categories
    c.max_new_tokens = 64
    c.gamma = 3                             # prompt lookup, fixed gamma (no calibration in the timing)
    c.seed = 0
    c.out = "experiments/cpu_levers/results/results.jsonl"
    if variant == "tiny":
        # (k = 1 and 2: each k is one more compiled forward per variant; the table's ratio needs two)
        c.update(target="tiny", ks=(1, 2), ctx=16, cost_iters=2, num_prompts=2, max_new_tokens=8,
                 variants=("bfloat16 XLA, 1 device", "float32 XLA, mesh model=2"),
                 out="/tmp/cpu_levers/results.jsonl")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: expected '' or 'tiny'")
    return c
