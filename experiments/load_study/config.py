"""Settings of the load study (`python -m experiments.load_study.run --config=<this file>[:tiny]`).

A fixed batch of `slots` rows kept full by `specjax.serving.Scheduler`, fed by Poisson arrivals
of held-out Spec-Bench requests at each rate in `rates` (requests/s; 0 = every request arrives
at once, the saturated server), once per mode: target-only decoding, prompt lookup at fixed
gamma, and adaptive drafting (gamma per round from the measured acceptance and round times
calibrated at batch = slots). The same requests and arrival times for every mode (paired).
Variant "tiny": a random small target and random prompts, seconds per mode (CI).
"""

import ml_collections

# mode name -> (drafter, gamma, adaptive)
MODES = {
    "target-only": ("none", 0, False),
    "prompt lookup, gamma 1": ("ngram", 1, False),
    "prompt lookup, gamma 3": ("ngram", 3, False),
    "adaptive prompt lookup": ("ngram", 4, True),
    "distilled draft, gamma 1": ("distilled", 1, False),
    "adaptive distilled draft": ("distilled", 4, True),
}


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    c.generate_config = "configs/generate.py"
    c.target = ""                           # "" = the generate config's target; "tiny": random (CI)
    c.modes = tuple(MODES)
    c.adaptive_gammas = (0, 1, 2, 3, 4)
    c.slots = 4
    c.num_requests = 24                     # held-out questions (seeded sample of those <= max_prompt_tokens)
    c.max_prompt_tokens = 320               # chat-templated; longer questions are left out (prefill time)
    c.max_new_tokens = 64
    c.rates = (0.25, 0.5, 1.0, 2.0, 0.0)    # requests/s; 0 = all at once
    c.temperature = 0.0
    c.seed = 0
    c.out = "experiments/load_study/results/results.jsonl"
    if variant == "tiny":
        c.update(target="tiny", modes=("target-only", "prompt lookup, gamma 3", "adaptive prompt lookup"),
                 adaptive_gammas=(0, 1, 3), slots=2, num_requests=6, max_new_tokens=8, rates=(20.0, 0.0),
                 out="/tmp/load_study/results.jsonl")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: expected '' or 'tiny'")
    return c
