"""Speculative generation with the default target (SmolLM2-135M-Instruct) on one chat prompt.

Run: specjax generate --config=configs/generate.py [--config.prompt="..."]

This is the CPU profile (float32, unrolled layers, fused projections, the CPU kernel);
configs/generate_tpu.py and configs/generate_gpu.py override the layout for accelerators.
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.target = "smollm2-135m-instruct"     # registry name, GGUF path or HF checkpoint dir
    c.dtype = "float32"
    c.scan_layers = False                   # unrolled layers + per-layer cache (XLA:CPU's fast path; PROFILE.md)
    c.fuse_projections = True               # q|k|v and gate|up as one matmul each
    # specjax's CPU matmul (specjax.kernels): a k-token verification block streams the weights
    # once, as a one-token step does. 'auto': on the CPU backend when the kernel was built for
    # this CPU (unrolled layers, float32); 'on': required; 'off': XLA's matmuls.
    c.cpu_kernel = "auto"
    # the attention op (specjax.models.attention): 'reference' (einsums, every model feature) or
    # 'dot_product' (jax.nn.dot_product_attention; no soft-capping)
    c.attention_op = "reference"
    # each layer writes the block's keys and values into its cache before it attends, so that a
    # verification block and a one-token step reduce in the same order (the accelerator profiles
    # set it; XLA:CPU copies the cache under it, and the CPU kernel attends first)
    c.write_then_attend = False
    # Drafter: a registered kind (specjax.drafters): 'hybrid' (prompt lookup where the text
    # repeats itself, the shipped draft head elsewhere), 'ngram' (prompt lookup), 'head' (the
    # shipped EAGLE head), 'distilled' (the draft shipped for the target, see experiments/distill),
    # 'early_exit' (target's first layers), 'model' (draft_model=), 'none'. Default 'hybrid' at a
    # fixed gamma 3, the fastest of them on the held-out prompts (experiments/bench_speed/results/
    # 2026-12-03-hybrid-amd-epyc, 2026-12-03-sampler-amd-epyc; figures in the README).
    # Each kind's own keys (draft_model, max_ngram, min_ngram, hybrid_model, min_match,
    # early_exit_layers, ...) are its settings class's fields, with their defaults and comments
    # (specjax/drafters); the command adds them to this config, so --config.max_ngram=4 works
    # and `specjax generate --help` lists them.
    c.drafter = "hybrid"
    c.gamma = 3                             # >= 0; adaptive_gamma overrides
    # Gamma per round from acceptance and calibrated round times (for the hybrid: an estimate,
    # a gamma and round times per draft source). Off by default: it did not beat the hybrid at
    # gamma 3 (experiments/bench_speed/results/2026-12-03-regimes-amd-epyc).
    c.adaptive_gamma = False
    c.adaptive_gammas = (0, 1, 2, 3, 4)
    # Row budgets among the adaptive candidates: each width (> 1) is a round that scores that many
    # positions per row in all (the root included) and hands them to the rows that accept best,
    # each row drafting 0 to max(adaptive_gammas) tokens (specjax.RowBudget; token verifier only).
    c.adaptive_budgets = ()
    # Adaptive gamma's round times per machine and setting (specjax.calibration): measured once,
    # then reused by later runs; "" = measure every run, nothing stored.
    c.calibration_cache = "~/.cache/specjax/calibration.json"
    c.recalibrate = False                   # measure even when the cache has the setting, then store
    # Linear drafts at T > 0: 'block' (Sun et al. 2025) keeps at least as many drafted tokens as
    # 'token' (Leviathan et al. 2023) in expectation for the same chain, for a little more work per
    # round (experiments/bench_speed/results/2026-12-03-sampler-amd-epyc). Greedy decoding uses
    # the greedy verifier either way.
    c.verifier = "block"
    # Token trees (specjax.trees): "" = linear drafts; 'branching:2,2,1', 'paths:0;1;0.0',
    # 'dynamic:depth,topk,budget' (EAGLE-2). A tree replaces gamma (and adaptive_gamma, unless
    # adaptive_trees lists static trees for the adaptive policy to choose among beside gammas).
    c.tree = ""
    c.adaptive_trees = ()                   # e.g. ('branching:2,1,1', 'branching:3,2,1,1')
    c.tree_verifier = "traversal"           # 'traversal' (Weng et al. 2025) or 'recursive' (SpecInfer)
    c.tree_children = "iid"                 # sampled trees: 'iid', 'without_replacement' or 'deterministic'
    c.temperature = 0.0
    c.top_k = 0
    c.top_p = 1.0
    # Penalties (specjax.sampling, "Penalties"): repetition (1 = off; prompt and generated tokens),
    # presence and frequency (0 = off; generated tokens), applied to the target and the draft.
    c.repetition_penalty = 1.0
    c.presence_penalty = 0.0
    c.frequency_penalty = 0.0
    # max_new_tokens: checked before the model loads (at most build.MAX_NEW_TOKENS_LIMIT, and
    # below a local target's context length read from its header), then per prompt by the
    # engine: prompt tokens + max_new_tokens <= the target's context length (max_position).
    c.max_new_tokens = 128
    # Tokens every target pass scores, padding after the real ones: 0 = each pass its own size;
    # -1 = the largest block the drafter drafts (gamma + 1, or a tree's nodes + 1), target-only
    # decoding included, so that a verification block's rows and a decode step are one
    # computation (the accelerator profiles set -1); N = at least that many.
    c.block_tokens = 0
    # XLA rounds every bfloat16 result as the program says (--xla_allow_excess_precision=false),
    # not keeping excess precision inside a fusion; the accelerator profiles set it with
    # block_tokens=-1 (specjax.build.strict_precision)
    c.strict_precision = False
    c.seed = 0
    c.system = ""
    c.prompt = ("Write a short Python function that returns the n-th Fibonacci number, "
                "then explain it in two sentences.")
    c.compare_target_only = True            # also time target-only decoding for the speedup
    c.metrics_jsonl = ""                    # append the run's stats as one JSON line
    c.compilation_cache_dir = "~/.cache/specjax/xla"  # persistent XLA cache: later runs skip compiling ("" = off)
    # Device mesh, used when the job has more than one device (multi-host, or CPU host devices from
    # --xla_force_host_platform_device_count): rows over data x fsdp, heads / MLP / vocabulary over
    # model; -1 = the devices the other axes leave. One device: no mesh.
    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, model=-1))
    c.distributed = False                   # start jax.distributed first (multi-host; see launch/README.md)
    return c
