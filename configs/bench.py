"""`specjax bench`: drafters against target-only decoding on the held-out Spec-Bench prompts.

Run: specjax bench --config=configs/bench.py [--config.drafters="('ngram','distilled')"]

Every setting of configs/generate.py applies to each drafter (gamma, adaptive gamma, trees,
temperature, top-k/top-p, target, layout); `drafter` and the single-prompt settings are replaced
by the keys below. Output: ``out``/results.jsonl and ``out``/results.md (see specjax.bench).
"""

from configs import generate


def get_config():
    c = generate.get_config()
    for key in ("drafter", "prompt", "system", "compare_target_only", "metrics_jsonl"):
        del c[key]                      # one prompt's settings; the bench has its own below
    # drafter kinds as in generate.py (not 'none': target-only always runs); 'head:<dir>' = a head
    # directory; '<kind>@key=value;key=value' = that drafter with generation settings of its own
    # (e.g. 'head@tree=dynamic:5,4,20' beside 'head': the head in a dynamic tree and in a chain)
    c.drafters = ("ngram", "distilled")
    c.prompts = ""                      # "" = Spec-Bench held-out split; else a JSONL file (turns or prompt)
    c.per_category = 1                  # prompts per category (file order); 0 = all
    c.num_prompts = 0                   # > 0: at most this many prompts in all
    c.out = "bench_results"             # results.jsonl + results.md
    c.progress = True                   # progress bar on stderr
    return c
