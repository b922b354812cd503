"""Settings of the batched-generation throughput study
(`python -m experiments.batch_decode.run --config=experiments/batch_decode/config.py[:tiny]`).

Target-only generation of Spec-Bench training prompts (first turns, chat template: the lengths
the data engine meets) at several batch sizes, through `specjax.decoding.generate_batched`
along each path: 'unsorted:C' cuts the prompts into batches in the order drawn (what one
`Generator.generate` call per batch does), 'sorted:C' sorts them by length first; C is the
prefill chunk (prompt tokens per prefill call); a third part 'attn' runs the target's decode
and verification attention through specjax.kernels.decode_attention (ModelConfig.cpu_attention).
"""

import ml_collections


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    c.target = "smollm2-135m-instruct"
    # (path, batch size, prompts): the first `prompts` of one seeded draw from the training split
    c.runs = (("unsorted:512", 1, 4), ("unsorted:512", 8, 32), ("unsorted:512", 32, 64), ("unsorted:512", 64, 64),
              ("sorted:128:attn", 1, 4), ("sorted:128:attn", 8, 32), ("sorted:128:attn", 32, 64),
              ("sorted:128:attn", 64, 64), ("sorted:128:attn", 128, 128), ("sorted:128", 64, 64))
    c.max_new_tokens = 128
    c.temperature = 1.0
    c.top_p = 0.95
    c.seed = 0
    c.pad_multiple = 64
    c.gemm = (4096, 576, 1536)             # the float32 product timed as the CPU's practical FLOP rate
    c.out = "experiments/batch_decode/results/results.jsonl"
    if variant == "tiny":
        c.update(target="preset:tiny", runs=(("unsorted:512", 1, 2), ("sorted:128:attn", 4, 6), ("sorted:64", 4, 6)),
                 max_new_tokens=8, gemm=(256, 64, 128), out="/tmp/batch_decode/results.jsonl")
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '' or 'tiny'")
    return c
