"""Settings of the long-prompt measurement (`python -m experiments.long_prompt.run --config=<this file>[:tiny]`).

Time to first token and peak resident memory of the main command's engine on one long prompt
(Spec-Bench questions concatenated into one chat turn), per prompt length and prefill chunk,
each in its own process (peak RSS is per process). Variant "tiny": a random 2-layer target.
"""

import ml_collections


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    c.target = "smollm2-135m-instruct"
    c.prompt_tokens = (1024, 4096, 7000)
    c.chunks = (512,)                      # prefill_chunk settings (0 = one call)
    c.unchunked_up_to = 2048               # also run chunk 0 for prompts up to this length
    c.max_new_tokens = 16
    c.main_command_tokens = (7000,)        # also run the whole main command (configs/generate.py) on these
    c.out = "experiments/long_prompt/results.jsonl"
    if variant == "tiny":
        c.update(target="preset:tiny", prompt_tokens=(256,), chunks=(64,), unchunked_up_to=256, max_new_tokens=4,
                 main_command_tokens=(),
                 out="/tmp/long_prompt/results.jsonl")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '' or 'tiny'")
    return c
