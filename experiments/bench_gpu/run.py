"""The speed measurements of experiments/bench_speed on any JAX device (CUDA GPU, TPU or CPU),
with a random-weight Llama-shaped target large enough to load a GPU.

    # on a GPU (defaults there: --size 8b --dtype bfloat16)
    python -m experiments.bench_gpu.run --size 8b --dtype bfloat16 --out experiments/bench_gpu/results/8b-bf16
    # the same script on CPU, CI size
    JAX_PLATFORMS=cpu python -m experiments.bench_gpu.run --size tiny --max_new_tokens 8 --repeats 1 --out /tmp/g

Measures, in one run: the device, its memory bandwidth (on-device copy and read of a large
array), target-only decode tokens/s per batch size (the engine's `autoregressive_generate`;
compile time separate; median over repeats), the memory roofline and the fraction of it
achieved, the k-token forward cost (k = 1..9) relative to k = 1, the early-exit draft's cost
relative to the target's, speculative decoding tokens/s with the early-exit draft and with an
oracle draft (per-round cost only), and the cost model's predicted speedups for a range of
acceptance rates. Writes `<out>/results.jsonl` and `<out>/README.md`; see README.md here.

Random weights give near-uniform, meaningless next-token distributions: measured acceptance
and speedups of the early-exit draft say nothing about a trained model. What transfers is the
*cost* side (seconds per target step, per verify of k tokens, per draft step, per round), and
the predicted speedups computed from those costs at assumed acceptance rates.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import sys
import time

import jax
import numpy as np

from specjax import analysis

from experiments.bench_gpu import measure, presets, report
from experiments.bench_speed import common, sj_bench

SIZES = tuple(presets.PRESETS)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default=None,
                   help="target shape preset (random weights); default 8b on an accelerator, tiny on CPU")
    p.add_argument("--model", default="", help="a registry name or checkpoint path (e.g. smollm2-135m-instruct) "
                   "to load real weights instead of a size preset")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="params and KV cache dtype; default bfloat16 on an accelerator, float32 on CPU")
    p.add_argument("--out", default=None, help="output directory (default experiments/bench_gpu/results/"
                   "<size>-<dtype>-<platform>)")
    p.add_argument("--batch", type=_ints, default=[1, 8], help="comma-separated batch sizes")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--prompt_len", type=int, default=128, help="random prompt ids per row")
    p.add_argument("--repeats", type=int, default=3, help="timed generations per configuration (median)")
    p.add_argument("--early_exit_layers", type=int, default=None,
                   help="layers of the early-exit draft (default max(1, num_layers // 8))")
    p.add_argument("--max_k", type=int, default=9, help="k-token forward costs for k = 1..max_k (at least gamma+1)")
    p.add_argument("--cost_iters", type=int, default=20, help="timed calls per forward / propose cost (median)")
    p.add_argument("--alphas", type=_floats, default=[0.6, 0.7, 0.8, 0.9],
                   help="acceptance rates at which to predict speedups from the measured costs")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the oracle draft assumes greedy)")
    p.add_argument("--bandwidth_gib", type=float, default=None,
                   help="bandwidth probe array size (default 2 GiB on an accelerator, 0.25 GiB on CPU)")
    p.add_argument("--bandwidth_repeats", type=int, default=10)
    p.add_argument("--pad_multiple", type=int, default=128, help="cache capacity rounded up to this")
    p.add_argument("--init_std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_git", action="store_true", help="leave the git commit out of the provenance")
    args = p.parse_args(argv)
    accel = jax.default_backend() != "cpu"
    if args.size is None:
        args.size = "8b" if accel else "tiny"
    if args.dtype is None:
        args.dtype = "bfloat16" if accel else "float32"
    if args.max_new_tokens < 1 or args.repeats < 1 or args.prompt_len < 1 or args.cost_iters < 1:
        p.error("max_new_tokens, repeats, prompt_len and cost_iters must be >= 1")
    if args.gamma < 1:
        p.error("gamma must be >= 1")
    if not args.batch or min(args.batch) < 1:
        p.error("batch sizes must be >= 1")
    if any(not 0 <= a < 1 for a in args.alphas):
        p.error("alphas must lie in [0, 1)")
    if args.temperature < 0:
        p.error("temperature must be >= 0")
    if args.bandwidth_gib is None:
        args.bandwidth_gib = 2.0 if accel else 0.25
    args.max_k = max(args.max_k, args.gamma + 1)
    if args.out is None:
        label = args.model.replace("/", "_") if args.model else args.size
        args.out = f"experiments/bench_gpu/results/{label}-{args.dtype}-{jax.default_backend()}"
    return args


def _log(msg: str):
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_target(args):
    """(model, params, description dict)."""
    t0 = time.perf_counter()
    if args.model:
        from specjax import build
        target, params = build.load_target(args.model, dtype=args.dtype)
        desc = {"weights": f"real: {args.model}", "preset": None, "random_weights": False}
    else:
        target, params = presets.build_target(args.size, args.dtype, args.seed, std=args.init_std)
        desc = {"weights": f"random normal(0, {args.init_std}) on device, seed {args.seed}",
                "preset": args.size, "shapes_of": presets.CHECKPOINT_NAMES[args.size], "random_weights": True}
    jax.block_until_ready(params)
    desc["load_s"] = time.perf_counter() - t0
    return target, params, desc


def weight_bytes(params) -> int:
    return int(sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params)))


def kv_bytes_per_token(config) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jax.numpy.dtype(config.dtype).itemsize


def roofline(w_bytes: int, kv_tok: int, batch: int, ctx_mean: float, capacity: int, bw_gb_s: float,
             measured_tokens_per_s: float) -> dict:
    """Bytes of one decode step of `batch` rows: every weight once plus every row's K and V at
    the mean context; roofline tokens/s = batch * bandwidth / bytes. The full-cache line counts
    all capacity slots (the engine's attention reads them all, masked)."""
    step = w_bytes + batch * kv_tok * ctx_mean
    full = w_bytes + batch * kv_tok * capacity
    rf = batch * bw_gb_s * 1e9 / step
    return {"batch": batch, "weight_bytes": w_bytes, "kv_bytes_per_context_token": kv_tok,
            "mean_context_tokens": ctx_mean, "bytes_per_decode_step": step, "bandwidth_gb_per_s": bw_gb_s,
            "roofline_tokens_per_s": rf, "capacity": capacity, "bytes_per_step_full_cache": full,
            "roofline_tokens_per_s_full_cache": batch * bw_gb_s * 1e9 / full,
            "measured_tokens_per_s": measured_tokens_per_s, "fraction_of_roofline": measured_tokens_per_s / rf}


def predictions(batch, gamma, alphas, t_step, verify_s, propose_s, ee_round_s, oracle_round_s, alpha_hat):
    """Predicted speedups over target-only decoding from the measured costs.

    cost_model: `analysis.RoundCost` with draft_s = propose(gamma) / gamma, verify_s = the k-token
      forward costs (k = 1: the measured target-only step), overhead = target-only seconds per step -
      1-token forward (the loop's own per-round cost). best_gamma searches 0..max_k - 1.
    early_exit_round: E[tokens per round](alpha, gamma) * t_step / the measured early-exit round.
    oracle_round_plus_draft: the same with the oracle run's round (free draft) + propose(gamma).
    """
    # verify_s[1] is only used for gamma = 0 (RoundCost charges overhead_s for gamma >= 1 only): set
    # it to the measured target-only step, loop overhead included, so gamma = 0 prices exactly 1x.
    overhead = max(0.0, t_step - verify_s[1])
    rc = analysis.RoundCost(draft_s=propose_s / gamma, verify_s={**verify_s, 1: t_step}, overhead_s=overhead)
    out = []
    cases = [(float(a), False) for a in alphas] + ([(float(alpha_hat), True)] if alpha_hat is not None else [])
    for a, measured in cases:
        a = min(max(a, 0.0), 1.0)
        e = analysis.expected_tokens_per_round(a, gamma)
        bg = rc.best_gamma(a)
        rec = {"batch": batch, "gamma": gamma, "alpha": a, "alpha_is_measured": measured,
               "expected_tokens_per_round": e, "target_s_per_step": t_step,
               "round_time_cost_model_s": rc.round_time(gamma),
               "speedup_cost_model": rc.predicted_speedup(a, gamma, t_step),
               "best_gamma_cost_model": bg, "speedup_at_best_gamma": rc.predicted_speedup(a, bg, t_step),
               "draft_s_per_token": rc.draft_s, "overhead_s": rc.overhead_s}
        if ee_round_s and np.isfinite(ee_round_s):
            rec["speedup_early_exit_round"] = e * t_step / ee_round_s
        if oracle_round_s and np.isfinite(oracle_round_s):
            rec["speedup_oracle_round_plus_draft"] = e * t_step / (oracle_round_s + propose_s)
        out.append(rec)
    return out


def run(args) -> dict:
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    dev = measure.device_info()
    _log(f"device: {dev['description']}; loading target ({args.model or args.size}, {args.dtype})")
    target, params, tdesc = load_target(args)
    cfg = target.config
    L = cfg.num_layers
    ee_layers = args.early_exit_layers or max(1, L // 8)
    if not 1 <= ee_layers < L:
        raise SystemExit(f"--early_exit_layers must be in [1, {L - 1}], got {ee_layers}")
    w_bytes = weight_bytes(params)
    kv_tok = kv_bytes_per_token(cfg)

    if not args.no_git:
        os.environ.setdefault("GIT_OPTIONAL_LOCKS", "0")    # git status without touching the index
    git = common.git_state(exclude=[out_dir]) if not args.no_git else {"git_commit": None, "git_dirty": None}
    prov = {
        "date_utc": common.utc_now(),
        "command": "python -m experiments.bench_gpu.run " + " ".join(shlex.quote(a) for a in getattr(args, "argv", [])),
        **git,
        "device": dev,
        "jax_version": jax.__version__,
        "size_preset": tdesc["preset"],
        "model": args.model or None,
        "dtype": args.dtype,
        "random_weights": tdesc["random_weights"],
        "machine": common.machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "argv"},
    }
    writer = common.JsonlWriter(out_dir / "results.jsonl", prov)
    res = {"provenance": prov, "notes": [], "generation": [], "forward_cost": [], "draft_cost": [], "roofline": [],
           "prediction": []}
    if tdesc["random_weights"]:
        res["notes"].append("random weights: acceptance and measured speedups of the early-exit draft say nothing "
                            "about a trained model; the speedups here are cost measurements, and the predictions "
                            "assume the listed acceptance rates")
    res["setup"] = writer.write(
        "setup", **tdesc, config={k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        param_count=int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))),
        weight_bytes=w_bytes, kv_bytes_per_context_token=kv_tok, early_exit_layers=ee_layers,
        peak_memory_bytes=measure.peak_memory_bytes())

    with common.CompileLog() as log:
        _log(f"bandwidth probe ({args.bandwidth_gib:g} GiB)")
        bw = measure.device_bandwidth(args.bandwidth_gib, args.bandwidth_repeats)
        res["bandwidth"] = writer.write("bandwidth", **bw)
        _log(f"bandwidth: copy {bw['copy']['best_gb_per_s']:.1f} GB/s, read {bw['read']['best_gb_per_s']:.1f} GB/s")

        from specjax import decoding
        from specjax.drafters import EarlyExitDrafter
        ee, ee_params = EarlyExitDrafter.from_target(target, params, ee_layers)
        oracle = measure.OracleDrafter(target.vocab_size)
        probe = decoding.GenerationConfig(max_new_tokens=args.max_new_tokens, gamma=args.gamma)
        capacity = decoding.capacity_for([args.prompt_len], probe, multiple=args.pad_multiple)
        ctx = int(round(args.prompt_len + args.max_new_tokens / 2))
        ks = list(range(1, args.max_k + 1))
        cost_cap = max(capacity, -(-(ctx + max(ks)) // args.pad_multiple) * args.pad_multiple)

        for B in args.batch:
            batch = measure.make_batch(target.vocab_size, B, args.prompt_len, capacity, args.seed)
            gens = {}
            pre = measure.time_prefill(target, params, batch, args.max_new_tokens, args.repeats, log)
            # -- target-only
            rec, ref = measure.run_generation(target, params, None, None, 0, batch, args.temperature,
                                              args.max_new_tokens, args.repeats, log, pre)
            gens["target_only"] = writer.write("generation", method="target_only", drafter="none", **rec)
            _log(f"B={B} target-only: {rec['tokens_per_s']:.1f} tok/s, compile {rec['compile_s']:.1f}s")
            ref_tokens = np.asarray(ref.tokens_BL)
            ref_gen = ref.generated()
            # -- speculative: early-exit draft, and the oracle (per-round cost with a free draft)
            for name, d, dp in (("early_exit", ee, ee_params), ("oracle", oracle, jax.numpy.asarray(ref_tokens))):
                rec, o = measure.run_generation(target, params, d, dp, args.gamma, batch, args.temperature,
                                                args.max_new_tokens, args.repeats, log, pre)
                rec["speedup_vs_target_only"] = rec["tokens_per_s"] / gens["target_only"]["tokens_per_s"]
                tested = sum(rec["tested_at"])
                rec["alpha_hat"] = sum(rec["accepted_at"]) / tested if tested else None
                if args.temperature == 0:
                    rec["greedy_rows_matching_target_only"] = sum(a == b for a, b in zip(o.generated(), ref_gen))
                gens[name] = writer.write("generation", method=name,
                                          drafter=f"early_exit_{ee_layers}_layers" if name == "early_exit" else name,
                                          **rec)
                _log(f"B={B} {name} gamma={args.gamma}: {rec['tokens_per_s']:.1f} tok/s "
                     f"({rec['speedup_vs_target_only']:.2f}x), alpha_hat {rec['alpha_hat']}, "
                     f"compile {rec['compile_s']:.1f}s")
            res["generation"] += list(gens.values())
            del ref

            # -- roofline
            t_only = gens["target_only"]
            rf = roofline(w_bytes, kv_tok, B, args.prompt_len + args.max_new_tokens / 2, capacity,
                          bw["gb_per_s"], t_only["tokens_per_s"])
            res["roofline"].append(writer.write("roofline", bandwidth_method=bw["method"], **rf))

            # -- k-token forward costs, draft costs
            _log(f"B={B} forward costs k=1..{max(ks)} at context {ctx}, capacity {cost_cap}")
            fc = measure.forward_costs(target, params, ks, B, ctx, cost_cap, args.cost_iters, log)
            for k, v in fc.items():
                res["forward_cost"].append(writer.write(
                    "forward_cost", model="target", batch=B, k=k, context=ctx, capacity=cost_cap,
                    iters=args.cost_iters, relative_to_k1=v["median_s"] / fc[1]["median_s"], **v))
            dfc = measure.forward_costs(ee.model, ee_params, [1], B, ctx, cost_cap, args.cost_iters, log)[1]
            prop = sj_bench.propose_cost(target, ee, ee_params, args.gamma, args.temperature, ctx, cost_cap,
                                         args.cost_iters, log, args.seed, batch=B)
            t1 = fc[1]["median_s"]
            dc = writer.write(
                "draft_cost", drafter=f"early_exit_{ee_layers}_layers", batch=B, gamma=args.gamma, context=ctx,
                capacity=cost_cap, layers=ee_layers, target_layers=L,
                forward_1_s=dfc["median_s"], forward_1_relative_to_target=dfc["median_s"] / t1,
                propose_s=prop["median_s"], propose_min_s=prop["min_s"], propose_compile_s=prop["compile_s"],
                propose_per_token_relative_to_target=prop["median_s"] / args.gamma / t1,
                layer_fraction=ee_layers / L)
            res["draft_cost"].append(dc)

            # -- predictions from the costs
            t_step = t_only["decode_s"] / args.max_new_tokens
            if not np.isfinite(t_step) or t_step <= 0:
                res["notes"].append(f"B={B}: target-only decode time lost in timing noise; no predictions")
                continue
            preds = predictions(B, args.gamma, args.alphas, t_step, {k: v["median_s"] for k, v in fc.items()},
                                prop["median_s"], gens["early_exit"]["seconds_per_round"],
                                gens["oracle"]["seconds_per_round"], gens["early_exit"]["alpha_hat"])
            for pr in preds:
                res["prediction"].append(writer.write("prediction", **pr))

        shaky = [f"B={g['batch']} {g['method']}" for g in res["generation"]
                 if not (g["decode_s"] == g["decode_s"] and g["decode_s"] > 0.25 * g["prefill_s"])]
        if shaky:
            res["notes"].append("decode time (full generation - prefill) is lost in timing noise or small next to "
                                f"the prefill for {', '.join(shaky)}: their tokens/s and the predictions built on "
                                "them are unreliable (raise --max_new_tokens / --repeats)")
        recompiled = sum(g["compiles_during_timing"] for g in res["generation"])
        if recompiled:
            res["notes"].append(f"{recompiled} compilations happened inside timed runs")

    res["wall_s"] = time.perf_counter() - t_start
    writer.write("run", wall_s=res["wall_s"], peak_memory_bytes=measure.peak_memory_bytes(),
                 loadavg_at_end=common.loadavg(), notes=res["notes"])
    writer.close()
    (out_dir / "README.md").write_text(report.render(res) + "\n", encoding="utf-8")
    res["paths"] = {"jsonl": str(out_dir / "results.jsonl"), "markdown": str(out_dir / "README.md")}
    return res


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    from specjax import build
    build.tune_xla_cpu()
    res = run(args)
    print(report.console_summary(res))
    return res


if __name__ == "__main__":
    main()
