"""What one decoding round costs, piece by piece (batch 1): the numbers behind PROFILE.md.

    python -m experiments.bench_speed.profile_round                      # SmolLM2, ngram + distilled
    python -m experiments.bench_speed.profile_round --layers scan        # the lax.scan layer loop
    python -m experiments.bench_speed.profile_round --model tiny --iters 3 --max_new_tokens 16

For each drafter and temperature, on one held-out Spec-Bench prompt (medians of `--iters`):

* target forward of k tokens (k = 1 and gamma + 1), logits only, and as a donated step that
  also writes the cache: the difference is the *cache update*;
* `drafter.propose` of gamma tokens (*draft*);
* the engine's round without the target: `speculative_generate` with a stand-in target whose
  forward is free (fixed logits, a one-slot cache); its time per round minus the draft's is
  *verification + sampling + bookkeeping* (probabilities, verifier, token writes, stopping,
  metrics, rollback);
* the real `speculative_generate` (time per round) and `autoregressive_generate` (time per
  token); what the pieces above do not explain is *unattributed* (e.g. copies XLA adds when
  the pieces run inside one `while_loop`);
* the adaptive-gamma loop pinned at gamma = 0 (time per token) against target-only decoding:
  what carrying the drafter and the per-round `lax.switch` cost when speculation is off.

The whole loop is one jitted call, so host overhead is once per generation, not per round:
*host + prefill* = wall time of a whole call minus its rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp

from experiments.bench_speed import common, sj_bench
from experiments.bench_speed.workload import load_workload
from specjax import decoding
from specjax.models import KVCache


@dataclasses.dataclass(frozen=True)
class FreeTarget:
    """A protocol model whose forward costs nothing: every position gets ``params['logits_V']``."""
    vocab_size: int

    def init_cache(self, batch_size: int, capacity: int) -> KVCache:
        return KVCache.zeros(1, batch_size, 1, capacity, 1)

    def apply(self, params, tokens_BT, cache, num_valid_B=None):
        B, T = tokens_BT.shape
        logits = jnp.broadcast_to(params["logits_V"], (B, T, self.vocab_size))
        n = T if num_valid_B is None else num_valid_B
        return logits, cache.advance(jnp.broadcast_to(jnp.asarray(n, jnp.int32), (B,)))


def _median_time(fn, args, iters):
    return common.median(sj_bench._time_many(fn, args, iters))


def donated_step_cost(model, params, k: int, ctx: int, capacity: int, iters: int) -> float:
    """Median seconds of a jitted, cache-donated k-token step (logits and the cache write)."""
    call = sj_bench.donated_step(model, params, k, ctx, capacity)
    call()                                                  # compile, warm up
    return common.median([common.timed(call)[0] for _ in range(iters)])


def per_round(run: dict) -> float:
    return run["decode_s"] / max(run["rounds"], 1)


def profile(args) -> list[dict]:
    w = load_workload(args.model, max(args.prompt_index + 1, 1), pathlib.Path(args.out) / "_work", 0,
                      with_transformers=False, layers=args.layers)
    inp = sj_bench.prepare_inputs(w, args.max_new_tokens, args.gamma, 128, seed=0)[args.prompt_index]
    log = common.CompileLog()
    log.__enter__()
    drafters = sj_bench.Drafters(w, early_exit_layers=4, max_ngram=3)
    runner = sj_bench.Runner(w, drafters, log, args.max_new_tokens, args.iters, eos_ids=())
    ctx = len(inp.prompt.ids) + args.max_new_tokens // 2
    cap, g = inp.capacity, args.gamma
    fwd = sj_bench.forward_cost(w.target, w.params, [1, g + 1], ctx, cap, args.iters, log)
    step = {k: donated_step_cost(w.target, w.params, k, ctx, cap, args.iters) for k in (1, g + 1)}
    # The stand-in target's logits: the real target's next-token logits after the prompt.
    logits_V = jax.jit(lambda p, t: w.target.apply(p, t, None)[0][0, -1])(w.params, inp.prompt_BP[:, :len(inp.prompt.ids)])
    free = FreeTarget(w.target.vocab_size)
    free_w = dataclasses.replace(w, target=free, params={"logits_V": logits_V})
    free_runner = sj_bench.Runner(free_w, drafters, log, args.max_new_tokens, args.iters, eos_ids=())

    records = []
    for temperature in args.temperatures:
        base = runner.run(sj_bench.DecodeConfig("target only", "none", 0), temperature, inp)
        base_tok = base["decode_s"] / max(base["new_tokens"], 1)
        records.append({"what": "target_only", "temperature": temperature, "layers": args.layers,
                        "per_token_ms": 1e3 * base_tok, "forward_1_ms": 1e3 * fwd[1]["median_s"],
                        "step_1_ms": 1e3 * step[1], "cache_update_1_ms": 1e3 * (step[1] - fwd[1]["median_s"]),
                        "loop_and_sampling_ms": 1e3 * (base_tok - step[1]),
                        "host_and_prefill_ms": 1e3 * (base["total_s"] - base["decode_s"])})
        for kind in args.drafters:
            drafter, dparams = drafters.get(kind)
            cfg = sj_bench.DecodeConfig(kind, kind, g)
            real = runner.run(cfg, temperature, inp)
            stub = free_runner.run(cfg, temperature, inp)
            prop = sj_bench.propose_cost(w.target, drafter, dparams, g, temperature, ctx, cap, args.iters,
                                         log)["median_s"]
            r_real, r_stub = per_round(real), per_round(stub)
            verify_book = r_stub - prop
            explained = prop + step[g + 1] + verify_book
            # The adaptive loop pinned at gamma = 0 (gamma-g rounds priced out, no probes): the cost
            # of carrying the drafter and the per-round lax.switch, against plain target-only decoding.
            pinned = decoding.AdaptiveGamma(gammas=(0, g), probe_every=10 ** 6)
            at0 = runner.run(sj_bench.DecodeConfig(f"{kind} pinned at 0", kind, pinned), temperature, inp,
                             round_time_s=[1.0, 1e6])
            records.append({"what": "adaptive_pinned_at_0", "drafter": kind, "temperature": temperature,
                            "layers": args.layers, "per_token_ms": 1e3 * at0["decode_s"] / max(at0["new_tokens"], 1),
                            "target_only_per_token_ms": 1e3 * base_tok, "rounds_per_gamma": at0["gamma_rounds"]})
            records.append({
                "what": "round", "drafter": kind, "gamma": g, "temperature": temperature, "layers": args.layers,
                "round_ms": 1e3 * r_real, "tokens_per_round": real["committed"] / max(real["rounds"], 1),
                "draft_ms": 1e3 * prop, "verify_forward_ms": 1e3 * fwd[g + 1]["median_s"],
                "cache_update_ms": 1e3 * (step[g + 1] - fwd[g + 1]["median_s"]),
                "verification_sampling_bookkeeping_ms": 1e3 * verify_book,
                "unattributed_ms": 1e3 * (r_real - explained),
                "target_step_1_ms": 1e3 * step[1], "target_only_per_token_ms": 1e3 * base_tok,
                "host_and_prefill_ms": 1e3 * (real["total_s"] - real["decode_s"]),
            })
    log.__exit__(None, None, None)
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--layers", choices=("fused", "unrolled", "scan"), default="fused")
    p.add_argument("--drafters", type=lambda s: [x for x in s.split(",") if x], default=["ngram", "distilled"])
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    p.add_argument("--prompt_index", type=int, default=0, help="which held-out prompt (round-robin order)")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default="/tmp/profile_round", help="directory; records appended to profile_round.jsonl")
    args = p.parse_args(argv)
    from specjax import build
    build.tune_xla_cpu()
    records = profile(args)
    prov = {"date_utc": common.utc_now(), **common.git_state(), "machine": common.machine(), "args": vars(args)}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "profile_round.jsonl", "a") as f:
        for r in records:
            f.write(json.dumps({**r, "provenance": prov}) + "\n")
    for r in records:
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}))


if __name__ == "__main__":
    main()
