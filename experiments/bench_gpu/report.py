"""Markdown report and console summary of a bench_gpu run."""

from __future__ import annotations

from experiments.bench_speed.report import markdown_table


def _f(x, fmt="{:.2f}", none="–"):
    if x is None:
        return none
    try:
        if x != x:   # NaN
            return none
        return fmt.format(x)
    except (TypeError, ValueError):
        return str(x)


def _ms(x):
    return _f(None if x is None else 1e3 * x, "{:.3f}")


def render(res: dict) -> str:
    prov = res["provenance"]
    setup = res["setup"]
    dev = prov["device"]
    cfg = setup["config"]
    s = prov["settings"]
    title = prov["model"] or (f"{prov['size_preset']} preset"
                              + (f" ({setup['shapes_of']} shapes)" if setup.get("shapes_of") else ""))
    lines = [f"# bench_gpu: {title}, {prov['dtype']}, on {dev['description']}", ""]
    lines += [
        f"* command: `{prov['command']}`",
        f"* date (UTC): {prov['date_utc']}; git commit {prov.get('git_commit') or 'unknown'}"
        f"{' (dirty)' if prov.get('git_dirty') else ''}; jax {prov['jax_version']}",
        f"* device: {', '.join(dev['devices'])}" + (f"; memory limit {dev['memory_bytes_limit'] / 2**30:.1f} GiB"
                                                      if dev.get("memory_bytes_limit") else ""),
        f"* host: {prov['machine']['cpu_model']}, {prov['machine']['cpus_usable']} usable CPUs, "
        f"load average at start {prov['machine']['loadavg_at_start']}",
        f"* target: {setup['weights']}; {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_heads']}/{cfg['num_kv_heads']} heads of {cfg['head_dim']}, FFN {cfg['ffn_size']}, "
        f"vocab {cfg['vocab_size']}, {'tied' if cfg['tie_embeddings'] else 'untied'} head; "
        f"{setup['param_count'] / 1e6:.1f} M parameters, {setup['weight_bytes'] / 2**30:.2f} GiB of weights; "
        f"loaded in {setup['load_s']:.1f} s",
        f"* workload: random prompts of {s['prompt_len']} tokens, {s['max_new_tokens']} new tokens (no EOS), "
        f"temperature {s['temperature']:g}, gamma {s['gamma']}, early-exit draft = first {setup['early_exit_layers']} "
        f"layers + head, {s['repeats']} timed repeats (median), warm-up excluded",
        "",
    ]
    if prov["random_weights"]:
        lines += ["> **Random weights.** Next-token distributions of a random model are meaningless, so the "
                  "early-exit draft's acceptance and measured speedup say nothing about a trained model. Read the "
                  "speedup columns as *cost* measurements; the predicted speedups below combine the measured costs "
                  "with assumed acceptance rates alpha.", ""]
    bw = res["bandwidth"]
    lines += ["## Memory bandwidth", "",
              markdown_table(["probe", "bytes moved", "median GB/s", "best GB/s"],
                     [[k, f"{bw[k]['bytes_moved'] / 2**30:.2f} GiB", _f(bw[k]["gb_per_s"], "{:.1f}"),
                       _f(bw[k]["best_gb_per_s"], "{:.1f}")] for k in ("copy", "read")]),
              "", f"Roofline bandwidth: {bw['gb_per_s']:.1f} GB/s (the best of the two). {bw['method']}.", ""]

    gens = res["generation"]
    rfs = {r["batch"]: r for r in res["roofline"]}
    lines += ["## Target-only decoding and the roofline", "",
              "decode = median full generation - median prefill; roofline = batch x bandwidth / (weights + "
              "batch x KV at the mean context); *full cache* counts every capacity slot (the attention reads "
              "them all, masked).", "",
              markdown_table(["batch", "tokens/s", "ms / step", "e2e tokens/s", "compile s", "roofline tokens/s",
                      "fraction", "roofline (full cache)"],
                     [[g["batch"], _f(g["tokens_per_s"], "{:.1f}"), _ms(g["decode_s"] / max(1, g["loop_rounds"])),
                       _f(g["e2e_tokens_per_s"], "{:.1f}"), _f(g["compile_s"], "{:.1f}"),
                       _f(rfs[g["batch"]]["roofline_tokens_per_s"], "{:.1f}"),
                       _f(100 * rfs[g["batch"]]["fraction_of_roofline"], "{:.1f}%"),
                       _f(rfs[g["batch"]]["roofline_tokens_per_s_full_cache"], "{:.1f}")]
                      for g in gens if g["method"] == "target_only"]), ""]

    fcs = res["forward_cost"]
    batches = sorted({r["batch"] for r in fcs})
    ks = sorted({r["k"] for r in fcs})
    by = {(r["batch"], r["k"]): r for r in fcs}
    if fcs:
        lines += ["## k-token forward cost", "",
                  f"One jitted target forward of k tokens per row at context {fcs[0]['context']} (capacity "
                  f"{fcs[0]['capacity']}), median of {fcs[0]['iters']} calls: ms, and relative to k = 1.", "",
                  markdown_table(["k"] + [f"B={b} ms" for b in batches] + [f"B={b} rel." for b in batches],
                         [[k] + [_ms(by[(b, k)]["median_s"]) for b in batches]
                          + [_f(by[(b, k)]["relative_to_k1"]) for b in batches] for k in ks]), ""]
    dcs = res["draft_cost"]
    if dcs:
        lines += ["## Draft cost", "",
                  markdown_table(["batch", "draft", "1-token forward ms", "vs target 1-token", "propose(gamma) ms",
                          "per draft token vs target step (c)", "layer fraction"],
                         [[d["batch"], d["drafter"], _ms(d["forward_1_s"]), _f(d["forward_1_relative_to_target"]),
                           _ms(d["propose_s"]), _f(d["propose_per_token_relative_to_target"]),
                           _f(d["layer_fraction"])] for d in dcs]), ""]
    lines += ["## Speculative decoding (measured)", "",
              "*oracle*: proposes target-only greedy output (free draft, acceptance ~1 under greedy): its round "
              "time is the cost of a round without the draft.", "",
              markdown_table(["batch", "method", "tokens/s", "speedup", "tokens / round / row", "alpha_hat",
                      "ms / round", "compile s", "greedy rows = target-only"],
                     [[g["batch"], g["method"], _f(g["tokens_per_s"], "{:.1f}"),
                       _f(g.get("speedup_vs_target_only")), _f(g["tokens_per_round_per_row"]),
                       _f(g.get("alpha_hat")), _ms(g["seconds_per_round"]), _f(g["compile_s"], "{:.1f}"),
                       f"{g['greedy_rows_matching_target_only']}/{g['batch']}"
                       if "greedy_rows_matching_target_only" in g else "–"] for g in gens]), ""]
    preds = res["prediction"]
    if preds:
        lines += ["## Predicted speedup from the measured costs", "",
                  "*cost model*: `analysis.RoundCost` (draft = propose(gamma)/gamma, verify = k-token forward, "
                  "overhead = target step - 1-token forward); *early-exit round*: E[tokens/round] x target step / "
                  "measured early-exit round; *oracle round + draft*: the same with the oracle's round + "
                  "propose(gamma). Rows marked * use the measured alpha_hat.", "",
                  markdown_table(["batch", "alpha", "E[tokens/round]", "cost model", "early-exit round",
                          "oracle round + draft", "best gamma (cost model)", "speedup at best gamma"],
                         [[p["batch"], _f(p["alpha"]) + (" *" if p["alpha_is_measured"] else ""),
                           _f(p["expected_tokens_per_round"]), _f(p["speedup_cost_model"]),
                           _f(p.get("speedup_early_exit_round")), _f(p.get("speedup_oracle_round_plus_draft")),
                           p["best_gamma_cost_model"], _f(p["speedup_at_best_gamma"])] for p in preds]), ""]
    if res["notes"]:
        lines += ["## Notes", ""] + [f"* {n}" for n in res["notes"]] + [""]
    lines += [f"Wall time of the run: {res['wall_s']:.0f} s."]
    return "\n".join(lines)


def console_summary(res: dict) -> str:
    out = []
    rfs = {r["batch"]: r for r in res["roofline"]}
    for g in res["generation"]:
        line = f"B={g['batch']:<3} {g['method']:<12} {_f(g['tokens_per_s'], '{:9.1f}')} tokens/s"
        if g["method"] == "target_only":
            rf = rfs[g["batch"]]
            line += (f"  (roofline {rf['roofline_tokens_per_s']:.1f} at {rf['bandwidth_gb_per_s']:.1f} GB/s: "
                     f"{100 * rf['fraction_of_roofline']:.1f}%)")
        else:
            line += f"  speedup {_f(g.get('speedup_vs_target_only'))}x, alpha_hat {_f(g.get('alpha_hat'))}"
        out.append(line)
    for p in res["prediction"]:
        if not p["alpha_is_measured"]:
            out.append(f"B={p['batch']:<3} alpha={p['alpha']:.2f} predicted speedup: cost model "
                       f"{_f(p['speedup_cost_model'])}x, early-exit round {_f(p.get('speedup_early_exit_round'))}x, "
                       f"oracle round + draft {_f(p.get('speedup_oracle_round_plus_draft'))}x")
    out.append(f"wrote {res['paths']['jsonl']} and {res['paths']['markdown']}")
    return "\n".join(out)
