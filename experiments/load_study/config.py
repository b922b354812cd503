"""Settings of the load study (`python -m experiments.load_study.run --config=<this file>[:tiny]`).

For each slot count in `slots`, one `specjax.serving.Scheduler` per mode serves held-out
Spec-Bench requests. The offered loads are fractions (`loads`) of the target-only server's
saturated rate at that slot count (requests/s, measured first, with every request at t = 0),
with Poisson and bursty arrivals (`arrivals`), plus every request at once; the same requests and
arrival times for every mode (paired). Rounds run at the smallest batch size holding the busy
rows (`buckets`, `specjax.serving.Buckets`) in every mode, target-only included. The live
scheduler (the engine thread of `specjax serve`, on the real clock) serves the same workload
at `live_loads` for `live_modes` at `live_slots`, to compare with the offline scheduler, both
submitted directly and over HTTP (`live_transports`).
Variant "tiny": a random small target and random prompts, seconds per mode (CI).
"""

import ml_collections

# mode name -> (drafter, gamma, adaptive[, row budgets]): adaptive modes pick gamma per round from
# the rows' acceptance and the round times measured at the batch size the round runs at; with row
# budgets (positions scored per row, `adaptive_budgets`) a round may also give each row its own
# gamma (up to the largest of adaptive_gammas) in one packed target pass.
MODES = {
    "target-only": ("none", 0, False),
    "hybrid, gamma 3": ("hybrid", 3, False),
    "load-aware hybrid": ("hybrid", 4, True),
    "load-aware hybrid, row budgets": ("hybrid", 4, True, (1.5, 2.5)),
    "prompt lookup, gamma 3": ("ngram", 3, False),
    "load-aware prompt lookup": ("ngram", 4, True),
    "load-aware prompt lookup, row budgets": ("ngram", 4, True, (1.5, 2.5)),
}


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    c.generate_config = "configs/generate.py"
    c.target = ""                           # "" = the generate config's target; "tiny": random (CI)
    c.modes = ("target-only", "load-aware hybrid", "load-aware hybrid, row budgets")
    c.adaptive_gammas = (0, 1, 2, 3, 4)
    c.slots = (1, 4, 16)                    # one server per slot count
    c.num_requests = (12, 24, 48)           # requests per slot count (seeded sample of held-out questions)
    c.buckets = "powers"                    # batch sizes rounds run at (specjax.serving.Buckets)
    c.loads = (0.1, 0.5, 0.9)               # offered load: fractions of target-only's saturated requests/s
    c.arrivals = ("poisson", "bursty")
    c.burstiness = 0.25                     # gamma shape of the bursty gaps (1 = Poisson)
    c.max_prompt_tokens = 320               # chat-templated; longer questions are left out (prefill time)
    c.max_new_tokens = 64
    c.temperature = 0.0
    c.seed = 0
    # Adaptive modes: timed rounds per gamma (medians, gammas taken in turn) at each batch size.
    c.calibration_repeats = 7
    c.live_slots = 4                        # the live scheduler's runs: this slot count only
    c.live_loads = (0.5, 0.9)
    c.live_modes = ("target-only", "load-aware hybrid, row budgets")
    # How live requests reach the scheduler: "engine" (submitted to it directly) and "http"
    # (streamed /v1/completions calls to `specjax serve`'s application on 127.0.0.1).
    c.live_transports = ("engine", "http")
    c.out = "experiments/load_study/results/results.jsonl"
    # Go on from an unfinished run of the same config (<out>.partial): finished (slot count, mode)
    # groups are kept, the rest run again.
    c.resume = False
    if variant == "tiny":
        c.update(target="tiny", modes=("target-only", "load-aware prompt lookup, row budgets"),
                 adaptive_gammas=(0, 3), slots=(2,), num_requests=(6,), max_new_tokens=8, loads=(0.5,),
                 calibration_repeats=3,
                 live_slots=2, live_loads=(0.5,), live_modes=("load-aware prompt lookup, row budgets",),
                 out="/tmp/load_study/results.jsonl")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: expected '' or 'tiny'")
    return c
