"""Speculative generation with the default target (SmolLM2-135M-Instruct) on one chat prompt.

Run: specjax generate --config=configs/generate.py [--config.prompt="..."]
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.target = "smollm2-135m-instruct"     # registry name, GGUF path or HF checkpoint dir
    c.dtype = "float32"
    c.scan_layers = False                   # unrolled layers + per-layer cache: ~2x faster at batch 1 on CPU
    c.fuse_projections = True               # q|k|v and gate|up as one matmul each
    # specjax's CPU matmul (specjax.kernels): a k-token verification block streams the weights
    # once, as a one-token step does. 'auto': on the CPU backend when the kernel was built for
    # this CPU (unrolled layers, float32); 'on': required; 'off': XLA's matmuls.
    c.cpu_kernel = "auto"
    # Drafter: 'ngram' (prompt lookup), 'distilled' (the draft shipped for the target, see
    # experiments/distill), 'head', 'early_exit' (target's first layers), 'model' (draft_model=),
    # 'none'. Default 'ngram': with the CPU kernel, adaptive prompt lookup is 1.28x target-only
    # on the held-out prompts at greedy, adaptive distilled 0.89x (experiments/bench_speed/
    # results/2026-12-01-kernel-amd-epyc); the shipped EAGLE-3 head 1.03x at gamma 1 against
    # 1.11x for adaptive prompt lookup in one run (results/2026-12-02-head-intel-xeon).
    c.drafter = "ngram"
    c.draft_model = ""                      # a draft directory or model path; "" = the shipped draft
    c.early_exit_layers = 4
    c.max_ngram = 3
    c.min_ngram = 1
    c.gamma = 4                             # >= 0; adaptive_gamma overrides
    c.adaptive_gamma = True                 # gamma per round from acceptance and calibrated round times
    c.adaptive_gammas = (0, 1, 2, 3, 4)
    # Adaptive gamma's round times per machine and setting (specjax.calibration): measured once,
    # then reused by later runs; "" = measure every run, nothing stored.
    c.calibration_cache = "~/.cache/specjax/calibration.json"
    c.recalibrate = False                   # measure even when the cache has the setting, then store
    c.verifier = "token"                    # 'token' or 'block'; greedy uses the greedy verifier
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
    # max_new_tokens: checked before the model loads (at most build.MAX_NEW_TOKENS_LIMIT, and
    # below a local target's context length read from its header), then per prompt by the
    # engine: prompt tokens + max_new_tokens <= the target's context length (max_position).
    c.max_new_tokens = 128
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
