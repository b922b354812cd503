"""Adaptive gamma's per-round cost against target-only decoding, outside the benchmark harness
(experiments/bench_speed/results/2026-12-02-head-intel-xeon/NOTES.md):

    python experiments/bench_speed/adaptive_overhead.py TEMPERATURE eos|noeos [tune]

`Engine.run` on held-out questions 84 and 104 (packed SmolLM2 target, n-gram drafter), best of
the last 3 of 4 runs per configuration: target-only, adaptive gamma forced to 0 (round times
that make every positive gamma lose, no probes), adaptive over (0,) only, gamma 0 with a
drafter. `tune` applies the main command's XLA options (`build.tune_xla_cpu()`) first.
"""
import time, sys
import jax, numpy as np
from specjax import build, models, decoding, sampling, specbench
if sys.argv[3:] == ["tune"]: print("tuned", build.tune_xla_cpu())
tname = "smollm2-135m-instruct"
target, params = build.load_target(tname, scan_layers=False, fuse_projections=True)
packed = models.Llama(target.config.replace(linear_op="panels")); pp = packed.prepare_params(params)
tok = models.load_tokenizer(tname)
qs = {q.question_id: q for q in specbench.load(split="held_out")}
prompts = [decoding.encode_prompt(tok, qs[i].prompt) for i in (84, 104)]
eos = tuple(int(i) for i in tok.stop_token_ids) if sys.argv[2] == "eos" else ()
drafter, dp = build.make_drafter("ngram", packed, pp)
samp = sampling.SamplingConfig.make(temperature=float(sys.argv[1]))
G = (0, 1, 2, 3, 4, 6)
def bench(name, gamma, rt=None, draft=True):
    cfg = decoding.GenerationConfig(max_new_tokens=128, gamma=gamma, eos_ids=eos)
    eng = decoding.Engine(packed, drafter if draft else None, cfg)
    ep = decoding.EngineParams(target=pp, draft=dp if draft else None)
    res = []
    for p in prompts:
        b = decoding.make_batch([p], cfg, jax.random.key(0), pad_multiple=128)
        ts = []
        for rep in range(4):
            t0 = time.perf_counter(); out = eng.run(ep, samp, b, rt); jax.block_until_ready(out.tokens_BS)
            ts.append(time.perf_counter() - t0)
        m = jax.device_get(out.metrics)
        res.append(f"{min(ts[1:]):.3f}s/{int(m.rounds_B[0])}r")
    print(f"{name:34s}", res, flush=True)
bench("target-only", 0, draft=False)
bench("adaptive forced 0, no probes", decoding.AdaptiveGamma(gammas=G, probe_every=10**6), [1.0] + [1e3] * 5)
bench("adaptive (0,) only", decoding.AdaptiveGamma(gammas=(0,)), [1.0])
bench("gamma 0 fixed + ngram drafter", 0)
bench("target-only", 0, draft=False)
