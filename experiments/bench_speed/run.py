"""The speed benchmark, everything measured in one run.

    python -m experiments.bench_speed.run --out experiments/bench_speed/results
    python -m experiments.bench_speed.run --model tiny --num_prompts 3 --max_new_tokens 8 --repeats 1 --out /tmp/b

Writes `<out>/results.jsonl` (one record per measurement, each with the provenance block) and
`<out>/README.md` (the summary tables). See `experiments/bench_speed/README.md`.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import shlex
import sys
import time

import numpy as np

from experiments.bench_speed import common, report, roofline, summarize
from experiments.bench_speed.hf_bench import common_prefix

DRAFTER_CHOICES = ("ngram", "early_exit", "distilled", "adaptive_ngram", "adaptive_early_exit", "adaptive_distilled")
MEMORY_DRAFTERS = ("ngram", "early_exit", "distilled")
HF_DRAFTERS = {"target_only": "none", "prompt_lookup": "prompt_lookup", "assisted_distilled": "distilled"}


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _names(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = [n for n in names if n not in DRAFTER_CHOICES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown drafter(s) {bad}; choose from {DRAFTER_CHOICES}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="experiments/bench_speed/results", help="output directory")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="registry name or GGUF path, or 'tiny' (random model built in code, for CI)")
    p.add_argument("--num_prompts", type=int, default=26, help="held-out Spec-Bench prompts (round-robin "
                   "over the 13 categories; 26 = 2 per category)")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and configuration (median)")
    p.add_argument("--temperatures", type=_floats, default=[0.0, 1.0], help="comma-separated, 0 = greedy")
    p.add_argument("--drafters", type=_names, default=["ngram", "early_exit", "adaptive_ngram"],
                   help=f"comma-separated subset of {DRAFTER_CHOICES}")
    p.add_argument("--ngram_gamma", type=int, default=4)
    p.add_argument("--early_exit_gamma", type=int, default=3)
    p.add_argument("--early_exit_layers", type=int, default=4)
    p.add_argument("--distilled_gamma", type=int, default=3)
    p.add_argument("--draft_model", default="", help="draft directory for 'distilled' (default: the one shipped "
                   "for --model)")
    p.add_argument("--adaptive_gammas", type=_ints, default=[0, 1, 2, 3, 4, 6])
    p.add_argument("--max_ngram", type=int, default=3, help="longest suffix n-gram matched (both frameworks)")
    p.add_argument("--verifier", choices=("token", "block"), default="token")
    p.add_argument("--max_k", type=int, default=9, help="k-token forward costs for k = 1..max_k "
                   "(extended to cover every gamma + 1 in the run)")
    p.add_argument("--cost_iters", type=int, default=30, help="timed calls per forward/propose cost")
    p.add_argument("--bandwidth_gib", type=float, default=1.0, help="size of the bandwidth probe array")
    p.add_argument("--bandwidth_threads", type=_ints, default=[1, 2])
    p.add_argument("--torch_threads", type=int, default=2)
    p.add_argument("--prompt_lookup_num_tokens", type=int, default=None,
                   help="transformers prompt lookup candidates per round (default: --ngram_gamma)")
    p.add_argument("--skip_transformers", action="store_true")
    p.add_argument("--skip_memory", action="store_true", help="skip the peak resident memory measurement")
    p.add_argument("--memory_drafter", choices=("auto",) + MEMORY_DRAFTERS, default="auto",
                   help="drafter of the memory measurement's speculative generation (auto: the distilled draft "
                        "where one exists for --model, else early_exit)")
    p.add_argument("--memory_prompts", type=int, default=2, help="prompts generated in the memory measurement")
    p.add_argument("--pad_multiple", type=int, default=128)
    p.add_argument("--layers", choices=("fused", "unrolled", "scan"), default="fused",
                   help="target layer loop: unrolled over per-layer params and cache buffers with fused q|k|v "
                        "and gate|up projections (the fast path on CPU at batch 1, see PROFILE.md), the same "
                        "unfused, or lax.scan over stacked layers")
    p.add_argument("--ignore_eos", action="store_true", help="always generate max_new_tokens tokens")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        p.error("num_prompts, max_new_tokens and repeats must be >= 1")
    if not args.temperatures or any(t < 0 for t in args.temperatures):
        p.error("temperatures must be >= 0")
    if args.prompt_lookup_num_tokens is None:
        args.prompt_lookup_num_tokens = args.ngram_gamma
    args.dtype = "float32"
    return args


def decode_configs(args):
    from specjax import decoding
    from experiments.bench_speed.sj_bench import DecodeConfig

    cfgs = [DecodeConfig("target_only", "none", 0)]
    for name in args.drafters:
        if name == "ngram":
            cfgs.append(DecodeConfig("ngram", "ngram", args.ngram_gamma))
        elif name == "early_exit":
            cfgs.append(DecodeConfig("early_exit", "early_exit", args.early_exit_gamma))
        elif name == "distilled":
            cfgs.append(DecodeConfig("distilled", "distilled", args.distilled_gamma))
        elif name == "adaptive_distilled":
            cfgs.append(DecodeConfig("adaptive_distilled", "distilled",
                                     decoding.AdaptiveGamma(gammas=tuple(args.adaptive_gammas))))
        elif name == "adaptive_ngram":
            cfgs.append(DecodeConfig("adaptive_ngram", "ngram", decoding.AdaptiveGamma(gammas=tuple(args.adaptive_gammas))))
        elif name == "adaptive_early_exit":
            cfgs.append(DecodeConfig("adaptive_early_exit", "early_exit",
                                     decoding.AdaptiveGamma(gammas=tuple(args.adaptive_gammas))))
    return cfgs


def distilled_draft_dir(args) -> str | None:
    """The distilled draft's directory (--draft_model, or the one shipped for --model), or None."""
    from specjax import build

    if args.draft_model:
        return args.draft_model
    return str(build.SHIPPED_DRAFTS[args.model]) if args.model in build.SHIPPED_DRAFTS else None


def run_memory(args, workdir: pathlib.Path) -> dict:
    """The peak-memory measurement (`memory.py`) in its own process: --memory_prompts prompts,
    --max_new_tokens tokens, target-only then speculative with --memory_drafter at its gamma."""
    from experiments.bench_speed import memory

    kind = args.memory_drafter
    if kind == "auto":
        kind = "distilled" if distilled_draft_dir(args) else "early_exit"
    gamma = {"ngram": args.ngram_gamma, "early_exit": args.early_exit_gamma, "distilled": args.distilled_gamma}[kind]
    return memory.measure(model=args.model, workdir=workdir / "memory", num_prompts=min(args.memory_prompts,
                          args.num_prompts), max_new_tokens=args.max_new_tokens, drafter=kind, gamma=gamma,
                          draft_model=args.draft_model, early_exit_layers=args.early_exit_layers,
                          max_ngram=args.max_ngram, pad_multiple=args.pad_multiple, layers=args.layers,
                          ignore_eos=args.ignore_eos, seed=args.seed)


def _log(msg: str):
    print(f"[bench_speed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def shape_groups(inputs) -> list[list[tuple[int, object]]]:
    """(index, input) pairs grouped by compiled shape (padded prompt width, capacity), in order
    of first appearance; inside a group the prompts keep their order."""
    groups: dict = {}
    for i, inp in enumerate(inputs):
        groups.setdefault((tuple(inp.prompt_BP.shape), inp.capacity), []).append((i, inp))
    return list(groups.values())


def max_map_count() -> int | None:
    try:
        return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


def map_count() -> int:
    """Memory mappings of this process (0 where /proc is not available)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def release_programs(runner, results: dict):
    """Drop every compiled program (and the runner's record of warmed shapes)."""
    import gc

    import jax

    results["map_count_peak"] = max(results["map_count_peak"], map_count())
    jax.clear_caches()
    gc.collect()
    runner.warmed.clear()


def generate_prompt(cfgs, runner, round_times, writer, gen_records, temp, i, inp, num_inputs):
    """Every configuration on one prompt at one temperature; greedy outputs checked against
    target-only's."""
    ref = None
    for cfg in cfgs:
        rec = runner.run(cfg, temp, inp, round_times(cfg, temp))
        rec.update(framework="specjax", method=cfg.name, drafter=cfg.drafter, config=cfg.describe(),
                   temperature=float(temp))
        if cfg.drafter == "none":
            ref = rec["generated_ids"]
        elif temp == 0 and ref is not None:
            rec["greedy_matches_target_only"] = rec["generated_ids"] == ref
            rec["greedy_common_prefix"] = common_prefix(rec["generated_ids"], ref)
        gen_records.append(rec)
        writer.write("generation", **rec)
        _log(f"T={temp:g} prompt {i + 1}/{num_inputs} (q{inp.prompt.question_id} "
             f"{inp.prompt.category}) {cfg.name}: {rec['new_tokens']} tokens, "
             f"{rec['tokens_per_s']:.1f} tok/s, compile {rec['compile_s']:.1f}s")


def run_benchmark(args) -> dict:
    """Runs every measurement; writes results.jsonl and README.md under args.out; returns the results."""
    from experiments.bench_speed import sj_bench
    from experiments.bench_speed.workload import load_workload

    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    load_at_start = common.loadavg()     # before the memory stage, whose own process loads the CPUs
    mem = None
    if not args.skip_memory:
        # First, in a fresh process, so nothing this process allocates is counted.
        _log("peak resident memory of a generation-only process (memory.py, own process)")
        mem = run_memory(args, out_dir / "_work")
        _log(f"memory: peak {mem['peak_above_import'] / 2**20:.0f} MiB above the post-import RSS, "
             f"{mem['ratio']:.2f}x weights + KV ({mem['reference_bytes'] / 2**20:.0f} MiB)")
    _log(f"loading {args.model}")
    t0 = time.perf_counter()
    w = load_workload(args.model, args.num_prompts, out_dir / "_work", args.seed,
                      with_transformers=not args.skip_transformers, layers=args.layers)
    load_s = time.perf_counter() - t0
    cfgs = decode_configs(args)
    max_gamma = max(c.max_gamma for c in cfgs)
    ks = list(range(1, max(args.max_k, max_gamma + 1) + 1))

    prov = {
        "date_utc": common.utc_now(),
        "command": "python -m experiments.bench_speed.run " + " ".join(shlex.quote(a) for a in (getattr(args, "argv", None) or [])),
        **common.git_state(exclude=[out_dir]),
        "model": w.name,
        "model_file": str(w.model_file),
        "model_sha256": w.model_sha256,
        "model_notes": w.notes,
        "prompt_ids": w.prompt_ids,
        "machine": common.machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "argv"},
    }
    prov["machine"]["loadavg_at_start"] = load_at_start
    writer = common.JsonlWriter(out_dir / "results.jsonl", prov)
    results = {"provenance": prov, "notes": []}
    load = load_at_start
    cpus = prov["machine"]["cpus_usable"] or 1
    if load and load[0] > 0.5 * cpus:
        results["notes"].append(f"the machine was busy when the run started (1-minute load average {load[0]:.1f} "
                                f"on {cpus} CPUs): timings, torch's above all, are unreliable")
        _log(results["notes"][-1])
    writer.write("setup", model_load_s=load_s, num_layers=w.target.config.num_layers,
                 vocab_size=w.target.vocab_size, eos_ids=list(w.eos_ids),
                 prompt_tokens=[len(p.ids) for p in w.prompts],
                 configs=[{"name": c.name, "description": c.describe()} for c in cfgs])
    if mem is not None:
        results["memory"] = mem
        writer.write("memory", **mem)

    eos_ids = () if args.ignore_eos else w.eos_ids
    inputs = sj_bench.prepare_inputs(w, args.max_new_tokens, max_gamma, args.pad_multiple, args.seed)
    drafters = sj_bench.Drafters(w, args.early_exit_layers, args.max_ngram, args.draft_model)

    with common.CompileLog() as log:
        # -- bandwidth
        _log(f"bandwidth probe ({args.bandwidth_gib} GiB)")
        bw = roofline.stream_bandwidth(args.bandwidth_gib, args.bandwidth_threads)
        results["bandwidth"] = bw
        writer.write("bandwidth", **bw)

        # -- k-token forward costs and draft costs, at a realistic context
        mean_plen = float(np.mean([len(p.ids) for p in w.prompts]))
        ctx = int(round(mean_plen + args.max_new_tokens / 2))
        caps = collections.Counter(i.capacity for i in inputs)
        cost_cap = max(caps.most_common(1)[0][0], -(-(ctx + max(ks)) // args.pad_multiple) * args.pad_multiple)
        _log(f"forward costs k={ks[0]}..{ks[-1]} at context {ctx}, capacity {cost_cap}")
        fc = {"context": ctx, "capacity": cost_cap, "iters": args.cost_iters,
              "target": sj_bench.forward_cost(w.target, w.params, ks, ctx, cost_cap, args.cost_iters, log)}
        for k, v in fc["target"].items():
            writer.write("forward_cost", model="target", k=k, context=ctx, capacity=cost_cap, iters=args.cost_iters,
                         relative_to_k1=v["median_s"] / fc["target"][1]["median_s"], **v)
        if any(c.drafter == "early_exit" for c in cfgs):
            ee, ee_params = drafters.get("early_exit")
            fc["draft_layers"] = drafters.early_exit_layers
            fc["draft"] = sj_bench.forward_cost(ee.model, ee_params, [1, 2], ctx, cost_cap, args.cost_iters, log)
            for k, v in fc["draft"].items():
                writer.write("forward_cost", model=f"early_exit_{drafters.early_exit_layers}_layers", k=k,
                             context=ctx, capacity=cost_cap, iters=args.cost_iters,
                             relative_to_target_k1=v["median_s"] / fc["target"][1]["median_s"], **v)
        fc["propose"] = []
        propose_s = {}
        needed = sorted({(c.drafter, g) for c in cfgs if c.drafter != "none" for g in c.gammas if g > 0})
        for temp in args.temperatures:
            for kind, g in needed:
                d, dp = drafters.get(kind)
                v = sj_bench.propose_cost(w.target, d, dp, g, temp, ctx, cost_cap, args.cost_iters, log, args.seed)
                propose_s[(kind, g, float(temp))] = v["median_s"]
                rec = {"drafter": kind, "gamma": g, "temperature": float(temp), "context": ctx,
                       "capacity": cost_cap, "per_token_relative_to_target_k1":
                       v["median_s"] / g / fc["target"][1]["median_s"], **v}
                fc["propose"].append(rec)
                writer.write("draft_cost", **rec)
        results["forward_costs"] = fc
        verify_s = {k: v["median_s"] for k, v in fc["target"].items()}

        def round_times(cfg, temp):
            """Calibrated per-gamma round times for the adaptive policy (from the costs above)."""
            if cfg.drafter == "none" or not hasattr(cfg.gamma, "gammas"):
                return None
            return [verify_s[1] if g == 0 else propose_s[(cfg.drafter, g, float(temp))] + verify_s[g + 1]
                    for g in cfg.gammas]

        # -- generation: per temperature, per compiled shape, per prompt, every configuration
        #    (interleaved, so slow drifts of a shared machine hit all configurations alike).
        #    The compiled programs of one shape are dropped before the next shape's: each
        #    unrolled 30-layer program holds ~700-2500 memory mappings of generated code, and a
        #    process that keeps them all reaches vm.max_map_count (65530 by default), after which
        #    LLVM cannot allocate and XLA crashes (PROFILE.md).
        runner = sj_bench.Runner(w, drafters, log, args.max_new_tokens, args.repeats, eos_ids, args.verifier)
        gen_records = []
        groups = shape_groups(inputs)
        results["map_count_peak"] = 0
        for temp in args.temperatures:
            for group in groups:
                release_programs(runner, results)
                for i, inp in group:
                    generate_prompt(cfgs, runner, round_times, writer, gen_records, temp, i, inp, len(inputs))
        release_programs(runner, results)
        _log(f"peak count of memory mappings: {results['map_count_peak']} (vm.max_map_count {max_map_count()})")
        writer.write("map_count", peak=results["map_count_peak"], max_map_count=max_map_count(),
                     shape_groups=len(groups))
        recompiled = sum(r["compiles_during_timing"] for r in gen_records)
        if recompiled:
            results["notes"].append(f"{recompiled} compilations happened inside timed specjax runs "
                                    "(their timings include compile time)")

    # -- transformers
    if not args.skip_transformers and w.hf_factory is not None:
        from experiments.bench_speed import hf_bench
        _log("transformers")
        sj_ref = {(r["question_id"], r["temperature"]): r["generated_ids"] for r in gen_records
                  if r["method"] == "target_only"}

        def on_hf(rec):
            ref = sj_ref.get((rec["question_id"], rec["temperature"]))
            if rec["temperature"] == 0 and ref is not None:
                rec["common_prefix_with_specjax_greedy"] = common_prefix(rec["generated_ids"], ref)
            rec.update(framework="transformers", drafter=HF_DRAFTERS[rec["method"]], config=rec["method"])
            writer.write("generation", **rec)
            _log(f"transformers T={rec['temperature']:g} q{rec['question_id']} {rec['method']}: "
                 f"{rec['new_tokens']} tokens, {rec['tokens_per_s']:.1f} tok/s")

        assistant = None
        draft_dir = distilled_draft_dir(args)
        if draft_dir is not None:
            _log(f"exporting the distilled draft {draft_dir} to Hugging Face format (transformers' assistant)")
            assistant = hf_bench.export_distilled_assistant(w, draft_dir, out_dir / "_work", args.distilled_gamma)
        else:
            results["notes"].append(f"transformers assisted generation with a distilled draft skipped: no distilled "
                                    f"draft for {args.model} (--draft_model)")
        hf_records = hf_bench.run_transformers(
            w, temperatures=args.temperatures, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
            threads=args.torch_threads, lookup_tokens=args.prompt_lookup_num_tokens, max_ngram=args.max_ngram,
            seed=args.seed, ignore_eos=args.ignore_eos, assistant=assistant, on_record=on_hf)
        gen_records += hf_records
    elif not args.skip_transformers:
        results["notes"].append("transformers comparison skipped: torch/transformers not available")

    # -- summaries and predictions
    target_s_per_token = {}
    for temp in args.temperatures:
        recs = [r for r in gen_records if r["framework"] == "specjax" and r["method"] == "target_only"
                and r["temperature"] == float(temp)]
        target_s_per_token[float(temp)] = sum(r["decode_s"] for r in recs) / max(sum(r["new_tokens"] for r in recs), 1)
    costs = {"verify_s": verify_s, "propose_s": propose_s, "target_s_per_token": target_s_per_token}
    summaries = summarize.summarize(gen_records, costs)
    for s in summaries:
        if s["framework"] == "specjax" and s["temperature"] == 0 and s["method"] != "target_only":
            recs = [r for r in gen_records if r["framework"] == "specjax" and r["method"] == s["method"]
                    and r["temperature"] == 0 and (s["category"] == summarize.ALL or r["category"] == s["category"])]
            s["greedy_matches"] = sum(bool(r.get("greedy_matches_target_only")) for r in recs)
    results["summaries"] = summaries

    # -- roofline (context from the greedy / first-temperature target-only runs)
    base_t = min(args.temperatures)
    base = [r for r in gen_records if r["framework"] == "specjax" and r["method"] == "target_only"
            and r["temperature"] == base_t]
    ctx_mean = float(np.mean([r["prompt_tokens"] + r["new_tokens"] / 2 for r in base]))
    cap_mean = float(np.mean([r["capacity"] for r in base]))
    best_bw = max(v["gb_per_s"] for v in bw["threads"].values())
    rf = roofline.roofline(w.params, w.target.config, ctx_mean, best_bw, cap_mean)
    for s in summaries:
        if s["category"] == summarize.ALL and s["method"] == "target_only" and s["temperature"] == base_t:
            rf[f"{s['framework']}_tokens_per_s"] = s["tokens_per_s"]
            rf[f"{s['framework']}_fraction"] = s["tokens_per_s"] / rf["roofline_tokens_per_s"]
    rf["temperature"] = base_t
    rf["bandwidth_method"] = bw["method"]
    results["roofline"] = rf
    writer.write("roofline", **rf)

    for s in summaries:
        writer.write("summary", **s)
    results["notes"].append(f"wall time of the whole benchmark: {time.perf_counter() - t_start:.0f} s; "
                            f"load average at the end: {common.loadavg()}")
    writer.write("run", wall_s=time.perf_counter() - t_start, loadavg_at_end=common.loadavg(), notes=results["notes"])
    writer.close()
    md = report.render(results)
    (out_dir / "README.md").write_text(md + "\n", encoding="utf-8")
    results["paths"] = {"jsonl": str(out_dir / "results.jsonl"), "markdown": str(out_dir / "README.md")}
    return results


def print_summary(results: dict):
    for s in results["summaries"]:
        if s["category"] != summarize.ALL:
            continue
        line = (f"{s['framework']:>12} {s['method']:<20} T={s['temperature']:g}: "
                f"{s['tokens_per_s']:8.1f} tokens/s")
        if "speedup" in s and s["method"] != "target_only":
            line += f", speedup {s['speedup']:.2f}x"
        if "predicted_speedup_iid" in s:
            line += f" (predicted {s['predicted_speedup_iid']:.2f}x)"
        if "tokens_per_target_pass" in s and s["method"] != "target_only":
            line += f", {s['tokens_per_target_pass']:.2f} tokens/target pass"
        if "specjax_best_speculative_over_this" in s:
            line += (f"; specjax's best speculative ({s['specjax_best_speculative_method']}) "
                     f"{s['specjax_best_speculative_over_this']:.2f}x this")
        print(line)
    mem = results.get("memory")
    if mem:
        print(f"memory: peak RSS {mem['peak_above_import'] / 2**20:.0f} MiB above the post-import level = "
              f"{mem['ratio']:.2f}x weights + KV cache ({mem['reference_bytes'] / 2**20:.0f} MiB); target "
              f"<= {mem['target_ratio']}x {'holds' if mem['holds'] else 'missed'}")
    rf = results.get("roofline", {})
    if rf:
        print(f"roofline {rf['roofline_tokens_per_s']:.1f} tokens/s at {rf['bandwidth_gb_per_s']:.1f} GB/s; "
              f"specjax at {100 * rf.get('specjax_fraction', float('nan')):.1f}% of it")
    print(f"wrote {results['paths']['jsonl']} and {results['paths']['markdown']}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    from specjax import build
    build.tune_xla_cpu()             # the main command's XLA CPU options (before any backend starts)
    results = run_benchmark(args)
    print_summary(results)
    return results


if __name__ == "__main__":
    main()
