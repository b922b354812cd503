"""Settings of the speed benchmark (`python -m experiments.bench_speed.run --config=<this file>[:VARIANT]`).

Variants: "" (SmolLM2-135M-Instruct, 26 held-out prompts, the committed table's workload),
"tiny" (CI: a random 4-layer Llama, seconds), "gpu" (a random Llama-3.1-8B-shaped target in
bfloat16 at batch 1 and 8, the GPU profile's layout; the former bench_gpu). Override anything on the command line,
e.g. ``--config.workload=preset:1b --config.batch_sizes=1,8,32``.
"""

import pathlib

import ml_collections

DRAFTERS = ("ngram", "early_exit", "distilled", "head", "hybrid", "oracle")
METHODS = DRAFTERS + tuple(f"adaptive_{d}" for d in DRAFTERS)


def get_config(variant: str = ""):
    c = ml_collections.ConfigDict()
    c.out = "experiments/bench_speed/results"
    # A registry name, GGUF path or HF checkpoint dir (real weights, Spec-Bench prompts in its chat
    # template), or preset:<tiny|smollm2|1b|3b|8b> (random weights with a real checkpoint's shapes,
    # random prompt ids; see workload.PRESETS).
    c.workload = "smollm2-135m-instruct"
    c.dtype = "float32"                    # float32 | bfloat16 (params and KV cache)
    # packed (fused + specjax.kernels' CPU matmul, the main command's CPU layout) | fused (unrolled +
    # fused projections, XLA's matmuls) | unrolled | scan
    c.layers = "packed"
    c.cost_layers = ("fused",)             # other layouts whose k-token curve is measured in the same run
    c.prefill_ks = (128, 512)              # prompt-chunk forwards (empty cache) timed in every layout (batch 1)
    c.num_prompts = 26                     # held-out questions, round-robin over the 13 categories
    c.prompt_len = 0                       # presets: prompt ids per row (0: 12..47 at random)
    c.batch_sizes = (1,)                   # rows per generate call (consecutive prompts)
    c.max_new_tokens = 128
    c.ignore_eos = False
    c.repeats = 3                          # timed runs per configuration (median)
    c.temperatures = (0.0, 1.0)
    c.methods = ("ngram", "early_exit", "adaptive_ngram")   # target-only always runs; see METHODS
    c.gamma = ml_collections.ConfigDict(dict(ngram=4, early_exit=3, distilled=3, head=1, hybrid=3, oracle=4))
    c.adaptive_gammas = (0, 1, 2, 3, 4, 6)
    c.early_exit_layers = 4                # 0: max(1, layers // 8)
    c.max_ngram = 3
    c.draft_model = ""                     # distilled: a draft directory ("" = the one shipped for the model)
    c.head_model = ""                      # head: a draft-head directory ("" = the one shipped for the model)
    c.hybrid_model = "head"                # hybrid: prompt lookup + this drafter ('head' or 'distilled')
    c.min_match = 0                        # hybrid: prompt lookup where the suffix match has >= this many tokens (0: max_ngram)
    c.verifier = "block"                   # linear drafts at T > 0, as the main command ('token' before 2026-12-03)
    # tokens every target pass scores (decoding.GenerationConfig.block_tokens): 0 = its own;
    # -1 = the largest block of the run's methods, target-only included (the GPU profile's)
    c.block_tokens = 0
    # the accelerator profiles' write-then-attend (`ModelConfig.write_then_attend`)
    c.write_then_attend = False
    c.max_k = 9                            # k-token forward costs for k = 1..max(max_k, gamma + 1)
    c.cost_iters = 30
    c.bandwidth_gib = 1.0
    c.bandwidth_threads = (1, 2)           # host (numpy) read probe on CPU
    c.transformers = True                  # the transformers comparison (batch 1, needs torch + transformers)
    c.torch_threads = 2
    c.memory = True                        # peak RSS of a generation-only process (own process)
    c.memory_prompts = 2
    c.memory_drafter = "auto"              # auto: the distilled draft where one ships, else early_exit
    c.alphas = ()                          # also predict speedups at these acceptance rates (report)
    c.pad_multiple = 128
    c.init_std = 0.02                      # presets' random weights
    c.seed = 0
    if variant == "tiny":
        c.update(workload="preset:tiny", num_prompts=2, prompt_len=16, max_new_tokens=24, repeats=2,
                 temperatures=(0.0,), max_k=3, cost_iters=3, prefill_ks=(32,), bandwidth_gib=0.03, torch_threads=1, memory_prompts=1,
                 adaptive_gammas=(0, 2), pad_multiple=64, init_std=0.2)
        c.gamma.update(ngram=2, early_exit=2, oracle=2)
    elif variant == "gpu":
        # the GPU profile's layout (configs/generate_gpu.py: unrolled, fused), the old one's k-token
        # costs in the same run (its scan copied every layer's weights on an H100; experiments/aot)
        c.update(workload="preset:8b", dtype="bfloat16", layers="fused", cost_layers=("scan",), prefill_ks=(), num_prompts=8, prompt_len=128,
                 batch_sizes=(1, 8), temperatures=(0.0,), methods=("early_exit", "oracle"), early_exit_layers=0,
                 transformers=False, memory=False, bandwidth_gib=2.0, cost_iters=20, alphas=(0.6, 0.7, 0.8, 0.9),
                 block_tokens=-1, write_then_attend=True)
        c.gamma.update(early_exit=4, oracle=4)
    elif variant:
        raise ValueError(f"unknown variant {variant!r}: '', 'tiny' or 'gpu'")
    return c


def check(c) -> None:
    """ValueError naming the setting and its allowed values for a bad one, before anything runs."""
    from specjax.models.config import SUPPORTED_DTYPES      # jax: only when a run checks its settings

    from experiments.lib import workload

    def bad(key, value, allowed):
        raise ValueError(f"config.{key}: {value!r} is not allowed; choose from {allowed}")

    for name in c.methods:
        if name not in METHODS:
            bad("methods", name, list(METHODS))
    workload.check_workload(c.workload)
    for name in c.cost_layers:
        if name not in workload.LAYOUTS:
            bad("cost_layers", name, list(workload.LAYOUTS))
    for key, allowed in (("layers", workload.LAYOUTS), ("dtype", SUPPORTED_DTYPES),
                         ("verifier", ("token", "block")), ("memory_drafter", ("auto",) + DRAFTERS[:3]),
                         ("hybrid_model", ("head", "distilled"))):
        if c[key] not in allowed:
            bad(key, c[key], list(allowed))
    for key in ("batch_sizes", "adaptive_gammas", "temperatures"):
        if not c[key] or any(v < 0 for v in c[key]):
            bad(key, tuple(c[key]), "a non-empty tuple of numbers >= 0")
    if any(b < 1 for b in c.batch_sizes):
        bad("batch_sizes", tuple(c.batch_sizes), "integers >= 1")
    for kind in {m for m in c.methods if not m.startswith("adaptive_")}:
        if kind not in c.gamma or int(c.gamma[kind]) < 1:
            bad(f"gamma.{kind}", c.gamma.get(kind), "an integer >= 1")
    if c.draft_model and not (pathlib.Path(c.draft_model) / "draft.json").is_file():
        raise ValueError(f"config.draft_model: {c.draft_model!r} is not a draft directory (no draft.json); give "
                         f"one written by specjax.distill, or '' for the draft shipped with the model")
    if c.head_model and not (pathlib.Path(c.head_model) / "head.json").is_file():
        raise ValueError(f"config.head_model: {c.head_model!r} is not a draft-head directory (no head.json); give "
                         f"one written by specjax.distill, or '' for the head shipped with the model")
