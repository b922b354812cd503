"""Load study: a slot-refilling server under Poisson arrivals, with and without speculation.

    python -m experiments.load_study.run --config=experiments/load_study/config.py
    python -m experiments.load_study.run --config=experiments/load_study/config.py:tiny   # CI size

For every mode of the config (target-only, fixed-gamma drafters, adaptive drafting) one
`specjax.serving.Scheduler` with `slots` rows serves the same held-out Spec-Bench requests
(chat template, greedy by default) at every arrival rate: per rate, Poisson arrival times
(seed = config seed + rate index, the same for every mode), each request admitted FIFO into
the first free slot (its prompt prefilled into that row while the others wait one call), the
rows advanced one engine round at a time, a finished row's slot refilled with the next waiting
request. Compilation is done before the timed runs (`Scheduler.warmup`); time in which nothing
is queued or running is skipped (the virtual clock, see `specjax.serving`), so low rates cost
no idle wall time. Adaptive modes calibrate their round times once, at batch = slots.

Records (JSONL, one run per file): "setup", "calibration" per adaptive mode, "load" per
(mode, rate): the scheduler's summary (throughput, time to first token, inter-token latency,
queue delay, engine rounds = target passes, accepted / wasted tokens, rounds per gamma),
how many requests got exactly target-only's tokens (greedy; batch-shape rounding can flip a
float near-tie, so this is recorded, not asserted), and per-request rows. Then `results.md`
(`report`) and the plots (`plot`) from the JSONL alone.
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

from experiments.lib import toolkit
from experiments.load_study import config as config_lib
from experiments.load_study import plot, report


def _log(msg: str):
    print(f"[load_study {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _setup(c):
    """(generation config, target, params, eos ids, prompts as token-id lists, extra provenance)."""
    from specjax import build, models, specbench
    gc = toolkit.load_config(c.generate_config)
    gc.update(max_new_tokens=int(c.max_new_tokens), temperature=float(c.temperature), calibration_cache="",
              adaptive_gammas=tuple(c.adaptive_gammas))
    rng = np.random.default_rng(c.seed)
    if c.target == "tiny":
        cfg = models.ModelConfig(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                                 head_dim=16, ffn_size=128, max_position=512, scan_layers=False, fuse_projections=True)
        model = models.Llama(cfg)
        params = model.prepare_params(model.init_params(jax.random.key(c.seed)))
        # Repetitive prompts so that prompt lookup finds matches.
        prompts = [list(np.tile(rng.integers(0, 512, 4), 6)[: int(n)]) for n in rng.integers(6, 24, c.num_requests)]
        return gc, model, params, (), prompts, {"model": "tiny random Llama"}
    if c.target:
        gc.target = c.target
    build.check_config(build.generate_settings(gc))
    target, params, tok = build.load_target_with_tokenizer(build.generate_settings(gc))
    from specjax import decoding
    encoded = [decoding.encode_prompt(tok, q.turns[0]) for q in specbench.load(split="held_out")]
    fits = [p for p in encoded if len(p) <= c.max_prompt_tokens]
    pick = rng.choice(len(fits), size=min(c.num_requests, len(fits)), replace=False)
    extra = {"model": gc.target}
    try:                                   # a registry name: its verified file and sha256
        path = models.registry.resolve(gc.target)
        extra.update(model_file=str(path), model_sha256=toolkit.sha256(path), model_notes="registry GGUF")
    except (ValueError, KeyError, FileNotFoundError):
        pass
    return gc, target, params, tuple(tok.stop_token_ids), [fits[i] for i in sorted(pick)], extra


def _engine(c, gc, target, params, eos_ids, mode: str):
    from specjax import build, decoding
    kind, gamma, adaptive = config_lib.MODES[mode]
    gm = gc.copy_and_resolve_references()
    gm.update(drafter=kind, gamma=int(gamma), adaptive_gamma=bool(adaptive))
    drafter, dparams = build.make_drafter(kind, target, params, draft_model=gm.draft_model, max_ngram=gm.max_ngram,
                                          min_ngram=gm.min_ngram, dtype=gm.dtype, scan_layers=gm.scan_layers,
                                          target_name=gm.target)
    return (decoding.Engine(target, drafter, build.generation_config(build.generate_settings(gm), eos_ids)),
            decoding.EngineParams(target=params, draft=dparams))


def arrivals(c, i: int) -> np.ndarray:
    """The arrival times at rate index i (0 = all at once), shared by every mode."""
    from specjax import serving
    rate = float(c.rates[i])
    return np.zeros(c.num_requests) if rate == 0 else serving.poisson_arrivals(c.num_requests, rate, c.seed + i)


def main(c):
    from specjax import decoding, sampling, serving
    prov = toolkit.provenance("experiments.load_study.run")
    gc, target, params, eos_ids, prompts, extra = _setup(c)
    prov.update(extra)
    c.num_requests = len(prompts)
    samp = sampling.SamplingConfig.make(temperature=float(c.temperature))
    key = jax.random.key(c.seed)
    pad = 64
    longest = max(len(p) for p in prompts)
    needs = []
    for mode in c.modes:
        engine, _ = _engine(c, gc, target, params, eos_ids, mode)
        needs.append(engine.config.slots_needed(longest))
    capacity = -(-max(needs) // pad) * pad
    out = toolkit.Jsonl(c.out, prov)
    out.write("setup", slots=c.slots, capacity=capacity, requests=len(prompts), prompt_tokens=[len(p) for p in prompts],
              max_new_tokens=c.max_new_tokens, temperature=c.temperature, rates=list(c.rates), modes=list(c.modes),
              cpu_kernel=target.config.linear_op == "panels", seed=c.seed)
    reference = {}                                  # request id -> target-only tokens (first rate)
    for mode in c.modes:
        engine, eparams = _engine(c, gc, target, params, eos_ids, mode)
        round_time_s = None
        if engine.config.adaptive:
            batch = decoding.make_batch(prompts[: c.slots], engine.config, key, capacity=capacity, pad_multiple=pad)
            round_time_s = tuple(engine.round_times(eparams, samp, batch, repeats=3))
            out.write("calibration", mode=mode, gammas=list(engine.config.gammas), round_time_s=list(round_time_s))
            _log(f"{mode}: round times at batch {c.slots}: {[round(1e3 * t, 1) for t in round_time_s]} ms")
        sched = serving.Scheduler(engine, eparams, slots=c.slots, pad_multiple=pad, capacity=capacity,
                                  round_time_s=round_time_s)
        requests0 = [serving.Request(i, p) for i, p in enumerate(prompts)]
        sched.warmup(samp, requests0, key)
        for i, rate in enumerate(c.rates):
            requests = [serving.Request(r, prompts[r], float(a)) for r, a in enumerate(arrivals(c, i))]
            res = sched.run(requests, samp, key, warmup=False)
            if mode == "target-only" and not reference:
                reference = {r.id: r.tokens for r in res.results}
            same = sum(r.tokens == reference.get(r.id) for r in res.results) if reference else None
            s = res.summary
            out.write("load", mode=mode, rate=float(rate), **s, same_tokens_as_target_only=same,
                      per_request=[r.record() for r in res.results])
            _log(f"{mode} @ {rate:g}/s: {s['throughput_tok_s']:.1f} tok/s, ttft p50 {s['ttft_s_p50']:.2f}s, "
                 f"itl p50 {1e3 * s['inter_token_s_p50']:.1f} ms, rounds {s['engine_rounds']}, "
                 f"tokens/pass {s['mean_accepted_tokens_per_pass']:.2f}, same {same}")
    out.close()
    md = c.out.rsplit("/", 1)[0] + "/results.md"
    with open(md, "w") as f:
        f.write(report.render(toolkit.read_jsonl(c.out)))
    for p in plot.plot(c.out):
        _log(f"wrote {p}")


if __name__ == "__main__":
    toolkit.main_with_config(main, "experiments/load_study/config.py", "load study settings")
