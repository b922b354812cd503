"""`specjax serve`: an OpenAI-compatible server for the default target and drafter.

Run: specjax serve --config=configs/serve.py [--config.port=8000 --config.slots=4]

Then any OpenAI client: base_url http://127.0.0.1:8000/v1, model "smollm2-135m-instruct".
The generation keys (target, drafter, layout, sampling, max_new_tokens) are configs/generate.py's;
the server's own keys follow.
"""

from configs import generate


def get_config():
    c = generate.get_config()
    del c["prompt"], c["system"], c["compare_target_only"], c["metrics_jsonl"], c["calibration_cache"], \
        c["recalibrate"], c["distributed"]
    c.host = "127.0.0.1"
    c.port = 8000                           # 0: a free port (printed at start)
    c.slots = 4                             # rows decoded together (continuous batching)
    # Batch sizes rounds run at (the smallest holding the busy rows): 'powers' (1, 2, 4, .. slots),
    # '' (every round at slots rows), or sizes such as '1,4'; each size compiles its own programs.
    c.buckets = "powers"
    c.max_queue = 64                        # waiting requests beyond which a request gets 429
    c.max_prompt_tokens = 1024              # the longest prompt a request may send (sizes every row's cache)
    c.model_name = ""                       # what clients send as "model" ("" = the target's name)
    c.drain_s = 30.0                        # at SIGTERM/SIGINT: time in-flight requests get to finish
    c.log_level = "warning"                 # uvicorn's
    return c
