"""Adaptive gamma pinned to gamma 0 against target-only decoding, in one process:

    python experiments/theory/adaptive_overhead.py      (from the repository root, PYTHONPATH=.)

The main command's settings (CPU kernel), the first held-out question of 6 categories, greedy,
64 tokens, batch 1, each run twice from one prefill and the second timed; the adaptive policy
gets round times that make every gamma > 0 look 10,000x dearer, so only its probe rounds draft.
Prints tokens/s of each and the gamma-0 round count."""
import time, jax, numpy as np
from specjax import build, decoding, sampling, specbench
from experiments.lib import toolkit
build.tune_xla_cpu(); build.limit_heap_retention()
gc = toolkit.load_config("configs/generate.py"); gc.update(max_new_tokens=64, calibration_cache="", compilation_cache_dir="")
target, params, tok = build.load_target_with_tokenizer(build.generate_settings(gc))
qs = specbench.one_per_category("held_out")[:6]
prompts = [decoding.encode_prompt(tok, q.turns[0]) for q in qs]
greedy = sampling.SamplingConfig.make(0.0)
res = {}
for name in ("target-only", "adaptive pinned to gamma 0", "target-only again"):
    gm = gc.copy_and_resolve_references()
    gm.update(drafter="none" if name.startswith("target") else "ngram", adaptive_gamma=not name.startswith("target"))
    gen = build.generator_for(build.generate_settings(gm), target, params, tok)
    rt = None if not gen.config.adaptive else tuple([1e-3] + [10.0] * (len(gen.config.gammas) - 1))
    secs, toks, g0 = 0.0, 0, 0
    for p in prompts:
        batch = gen.batch([p], jax.random.key(0))
        pre = gen.prefill(batch)
        jax.block_until_ready(gen.engine.run(gen.params, greedy, batch, rt, prefill=pre).tokens_BS)
        t = time.perf_counter()
        out = jax.block_until_ready(gen.engine.run(gen.params, greedy, batch, rt, prefill=pre))
        secs += time.perf_counter() - t
        toks += len(out.generated()[0])
        g0 += int(np.asarray(out.metrics.gamma_rounds_Z)[0])
    res[name] = (toks / secs, toks, g0)
    print(name, f"{toks / secs:.1f} tok/s, {toks} tokens, gamma-0 rounds {g0}", flush=True)
print(open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0])
