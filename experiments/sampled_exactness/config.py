"""Settings of the sampled-path exactness check on the real target
(`python -m experiments.sampled_exactness.run --config=experiments/sampled_exactness/config.py[:variant]`).

Each entry of `runs` is "drafter:gamma:verifier" (gamma an integer, or "adaptive" for adaptive
gamma over (0, 1, 2, 3) with fixed round times), optionally ":misreported" (the negative
control: the drafter reports a q sharper than the one it sampled from, q^2 renormalized; the
test must reject it). Every run samples `samples` rows of the first two committed tokens of
each prompt (raw text, no chat template, EOS an ordinary token), at each sampling setting of
`sampling` ("temperature:top_p"); the target and its layout come from configs/generate.py.

Variant "ci": the CI size (the early-exit draft with the block verifier and the negative
control, 384 samples, one prompt, gamma 1).
"""

import ml_collections


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    c.generate_config = "configs/generate.py"   # target, dtype, layout, early_exit_layers, max_ngram
    c.target = ""                               # "" = the generate config's target
    # Layout: stacked layers under lax.scan with XLA's matmuls. The rows are many (a batch of
    # `batch_size`), so each forward is compute-bound and the layout hardly changes its speed,
    # while the unrolled 30-layer program takes several times longer to compile.
    c.scan_layers = True
    c.cpu_kernel = "off"
    c.draft_model = ""                          # "" = the generate config's (drafter "model" needs one)
    c.prompts = ("The three most important things to know about the ocean are",
                 "one two three four, one two three four, one two three")
    c.sampling = ("1.0:0.9",)                   # temperature:top_p
    c.runs = ("ngram:4:token", "ngram:4:block", "early_exit:2:token", "early_exit:2:block",
              "distilled:3:token", "distilled:3:block", "distilled:adaptive:token",
              "early_exit:2:token:misreported")
    c.samples = 2048                            # rows per (run, prompt, sampling setting)
    c.batch_size = 512                          # rows per engine call
    c.min_expected = 5.0                        # cells with fewer expected counts are pooled
    c.family_alpha = 1e-3                       # family-wise false-alarm rate of the exact runs (Bonferroni)
    c.seed = 0
    c.out = "experiments/sampled_exactness/results/results.jsonl"
    if variant == "ci":
        c.update(prompts=c.prompts[:1], samples=384, runs=("early_exit:1:block", "early_exit:1:token:misreported"),
                 out="/tmp/sampled_exactness/results.jsonl")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '' or 'ci'")
    return c
