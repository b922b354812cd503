"""Settings of the server soak (`python -m experiments.serve_soak.run --config=<this file>[:short]`).

`specjax serve` (configs/serve.py: the default target and drafter) started as a subprocess on
127.0.0.1, then `clients` threads send requests for `duration_s`: greedy chat answers, streamed
sampled answers with seeds, streams dropped after their first text, stop sequences, penalized
greedy answers, answers under a JSON schema, and bad requests (one of several kinds each time),
mixed by a seeded draw. Then a SIGTERM while `drain_requests` long answers are in flight.
Variant "short": a one-minute soak; "fluctuating": clients that pause between actions, so the
server resizes its batch as the load rises and falls.
"""

import ml_collections

# action -> weight of the seeded draw
MIX = {"greedy": 4, "sampled_stream": 3, "cancel": 1, "stop": 1, "penalized": 1, "schema": 1, "bad": 1}


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    c.serve_config = "configs/serve.py"
    c.slots = 4
    c.buckets = "powers"                 # batch sizes rounds run at (`specjax serve --config.buckets`)
    c.max_new_tokens = 48
    c.max_prompt_tokens = 512
    c.duration_s = 600.0
    c.clients = 6
    c.think_s = 0.0                      # mean pause of a client between its actions (0: none, a saturated server)
    c.prompts = 24                       # held-out Spec-Bench questions, cut to their first 300 characters
    c.mix = tuple(MIX.items())
    c.drain_requests = 4
    c.drain_s = 60.0
    c.seed = 0
    c.startup_timeout_s = 900.0
    c.out = "experiments/serve_soak/results/results.jsonl"
    if variant == "fluctuating":
        # Clients pause between actions (exponential, mean think_s), so the number of busy rows
        # rises and falls and the server moves between batch sizes (buckets) while requests are
        # cancelled, stopped and refused.
        c.clients, c.think_s = 8, 3.0
        c.out = "experiments/serve_soak/results/fluctuating.jsonl"
    elif variant == "short":
        c.duration_s = 60.0
        c.out = "/tmp/serve_soak_short.jsonl"
    elif variant:
        raise ValueError(f"unknown variant {variant!r}")
    return c
