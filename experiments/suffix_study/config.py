"""Settings of the suffix study (`python -m experiments.suffix_study.run --config=<this file>[:tiny]`).

The repetitive workload (`workload.py`: requests from six task templates with different inputs)
served by `specjax.serving.Scheduler` (all requests queued at once, FIFO), once per mode and slot
count, greedy:
target-only, prompt lookup, suffix decoding over the request alone, suffix decoding that adds
every finished request to its corpus (`draft_update`), the main command's default drafter
(the hybrid of prompt lookup and the shipped EAGLE head), and the suffix-hybrid (suffix decoding
across requests where the context's suffix matches, the shipped head elsewhere). Fixed gamma for
every drafter.
Variant "tiny": a random small target and the workload's token ids cut to its vocabulary (CI).
"""

import ml_collections

# mode name -> (drafter kind, learns from finished requests, generation settings over the config's)
MODES = {
    "target-only": ("none", False, {}),
    "prompt lookup": ("ngram", False, {}),
    "suffix, own request": ("suffix", False, {}),
    "suffix, across requests": ("suffix", True, {}),
    "hybrid (default)": ("hybrid", False, {}),
    # suffix decoding across requests where the suffix matches (3+ tokens), the shipped head elsewhere
    "suffix-hybrid, across requests": ("hybrid", True, {"hybrid_lookup": "suffix"}),
}


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    c.generate_config = "configs/generate.py"
    c.target = ""                   # "" = the generate config's target; "tiny": random (CI)
    c.modes = tuple(MODES)
    c.gamma = 3
    c.slots = (1, 4)                # one run of every mode per slot count
    c.num_requests = 48
    c.max_new_tokens = 48
    c.suffix_tokens = 65536         # the corpus ring's slots
    c.seed = 0
    c.out = "experiments/suffix_study/results/results.jsonl"
    if variant == "tiny":
        c.update(target="tiny", modes=("target-only", "suffix, across requests"), slots=(2,), num_requests=6,
                 max_new_tokens=8, suffix_tokens=1024, out="/tmp/suffix_study/results.jsonl")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: expected '' or 'tiny'")
    return c
