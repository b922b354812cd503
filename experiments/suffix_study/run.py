"""Suffix decoding on a repetitive workload, against prompt lookup, the default drafter and
target-only decoding, through the slot scheduler.

    python -m experiments.suffix_study.run --config=experiments/suffix_study/config.py
    python -m experiments.suffix_study.run --config=experiments/suffix_study/config.py:tiny   # CI size

Every mode serves the same requests (`workload.make`, chat template, greedy) with each of the
config's slot counts, all queued at once and admitted FIFO; compilation is done before the timed run
(`Scheduler.warmup`). The learning mode starts from an empty corpus and adds each finished
request's prompt and answer to it (`SuffixCache`, `Scheduler.run(draft_update=)`), so the
first requests of each template are drafted from their own text only. Records (JSONL): "setup",
then one "mode" record each: the scheduler's summary (throughput, target passes, tokens per
pass), tokens per pass by template, and how many requests got exactly target-only's tokens.
Then `results.md` and `suffix_study.png` from the JSONL alone (`report`).
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

from experiments.lib import toolkit
from experiments.suffix_study import config as config_lib
from experiments.suffix_study import report, workload


def _log(msg: str):
    print(f"[suffix_study {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _setup(c):
    """(generation config, target, params, eos ids, requests [(template, token ids)], provenance extra)."""
    from specjax import build, decoding, models
    gc = toolkit.load_config(c.generate_config)
    gc.update(max_new_tokens=int(c.max_new_tokens), temperature=0.0, calibration_cache="", gamma=int(c.gamma),
              adaptive_gamma=False, suffix_tokens=int(c.suffix_tokens))
    reqs = workload.make(int(c.num_requests), int(c.seed))
    if c.target == "tiny":
        cfg = models.ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                 head_dim=16, ffn_size=128, max_position=512, scan_layers=False)
        model = models.Llama(cfg)
        params = model.prepare_params(model.init_params(jax.random.key(c.seed)))
        ids = [[b % 512 for b in r["prompt"].encode()][:48] for r in reqs]
        return gc, model, params, (), [(r["template"], p) for r, p in zip(reqs, ids)], {"model": "tiny random Llama"}
    if c.target:
        gc.target = c.target
    target, params, tok = build.load_target_with_tokenizer(build.generate_settings(gc))
    extra = {"model": gc.target}
    try:
        path = models.registry.resolve(gc.target)
        extra.update(model_file=str(path), model_sha256=toolkit.sha256(path))
    except (ValueError, KeyError, FileNotFoundError):
        pass
    encoded = [(r["template"], decoding.encode_prompt(tok, r["prompt"])) for r in reqs]
    return gc, target, params, tuple(tok.stop_token_ids), encoded, extra


def _engine(gc, target, params, eos_ids, kind: str, settings=None):
    from specjax import build, decoding
    gm = gc.copy_and_resolve_references()
    gm.update(drafter=kind, gamma=0 if kind == "none" else int(gm.gamma), **(settings or {}))
    own = {k: gm[k] for k in gm if k not in ("drafter", "dtype", "scan_layers", "target")}
    drafter, dparams = build.make_drafter(kind, target, params, dtype=gm.dtype, scan_layers=gm.scan_layers,
                                          target_name=gm.target, **own)
    return (decoding.Engine(target, drafter, build.generation_config(build.generate_settings(gm), eos_ids)),
            decoding.EngineParams(target=params, draft=dparams))


def main(c):
    from specjax import drafters, sampling, serving
    prov = toolkit.provenance("experiments.suffix_study.run")
    gc, target, params, eos_ids, reqs, extra = _setup(c)
    prov.update(extra)
    samp = sampling.SamplingConfig.greedy_config()
    key = jax.random.key(c.seed)
    pad = 64
    templates = [t for t, _ in reqs]
    out = toolkit.Jsonl(c.out, prov)
    out.write("setup", slots=list(c.slots), requests=len(reqs), gamma=c.gamma, max_new_tokens=c.max_new_tokens,
              suffix_tokens=c.suffix_tokens, templates=templates, prompt_tokens=[len(p) for _, p in reqs],
              modes=list(c.modes), seed=c.seed)
    reference = {}
    for slots, mode in [(s, m) for s in c.slots for m in c.modes]:
        kind, learns, settings = config_lib.MODES[mode]
        engine, eparams = _engine(gc, target, params, eos_ids, kind, settings)
        update = None
        if learns:                      # an empty corpus that every finished request joins
            cache = drafters.SuffixCache(int(c.suffix_tokens))
            # the suffix drafter's params are its corpus; the suffix-hybrid's hold it beside the head's
            with_corpus = (eparams.draft.replace if isinstance(eparams.draft, drafters.HybridParams)
                           else lambda lookup: lookup)
            eparams = eparams.replace(draft=with_corpus(lookup=cache.corpus()))

            def update(request, result, cache=cache, with_corpus=with_corpus):
                cache.add(list(request.prompt) + list(result.tokens))
                return with_corpus(lookup=cache.corpus())
        longest = max(len(p) for _, p in reqs)
        capacity = -(-engine.config.slots_needed(longest) // pad) * pad
        sched = serving.Scheduler(engine, eparams, slots=slots, pad_multiple=pad, capacity=capacity)
        requests = [serving.Request(i, p) for i, (_, p) in enumerate(reqs)]
        sched.warmup(samp, requests, key)
        t0 = time.perf_counter()
        res = sched.run(requests, samp, key, warmup=False, draft_update=update)
        wall = time.perf_counter() - t0
        if mode == "target-only" and not reference:
            reference = {r.id: r.tokens for r in res.results}
        same = sum(r.tokens == reference.get(r.id) for r in res.results) if reference else None
        by_template = {}
        for r in res.results:
            t = by_template.setdefault(templates[r.id], [0, 0])
            t[0] += len(r.tokens)
            t[1] += r.counters["target_passes"]
        s = res.summary
        out.write("mode", mode=mode, drafter=kind, learns=learns, wall_s=wall, **s, same_tokens_as_target_only=same,
                  tokens_per_pass_by_template={k: v[0] / max(v[1], 1) for k, v in by_template.items()},
                  per_request=[r.record() for r in res.results])
        _log(f"{slots} slots, {mode}: {s['throughput_tok_s']:.1f} tok/s, tokens/pass {s['mean_accepted_tokens_per_pass']:.2f}, "
             f"same as target-only {same}/{len(reqs)}")
    out.close()
    for p in report.write(c.out):
        _log(f"wrote {p}")


if __name__ == "__main__":
    toolkit.main_with_config(main, "experiments/suffix_study/config.py", "suffix study settings")
