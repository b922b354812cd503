"""The benchmark's tables (README.md) and plot (plots.png, with matplotlib), from its JSONL alone.

    python -m experiments.bench_speed.report experiments/bench_speed/results/results.jsonl
    python -m experiments.bench_speed.report /tmp/bench/results.jsonl --targets= --out=/tmp/report

Aggregation per (framework, method, temperature, batch size, category) and over all prompts:
tokens/s = generated tokens / decode seconds, both summed over batches (a throughput: long
answers weigh more, as in Spec-Bench); speedup = that / target-only's of the same framework,
temperature, batch size and prompts in the same run. Categories only for batches whose rows
share one (batch 1). alpha_hat = sum accepted_at / sum tested_at (every tested draft position
one Bernoulli trial: the position-independent maximum-likelihood acceptance); acceptance per
position a_j = accepted_at[j] / tested_at[j].

Predicted speedup (Leviathan et al. 2023, Sec. 3, with this run's measured costs,
`specjax.analysis.RoundCost`): round(g) = propose(g) + forward(g + 1) + overhead, overhead =
target-only seconds per step over all prompts - forward(1), round(0) = target-only seconds per
step; speedup = E[tokens per round] x (seconds per step) / round(g), rounds priced and counted
per gamma actually run (adaptive). E: *iid* = (1 - a^(g+1)) / (1 - a) at a = alpha_hat; *pos* =
1 + sum_j prod_{i<=j} a_i; *cost* = the measured tokens per round (tests the cost model alone).

Targets: every row of the targets file (`targets.json`: a metric and a bound) checked on the run.
"""

from __future__ import annotations

import collections
import json
import math
import pathlib

import numpy as np
from absl import app, flags

from specjax import analysis

from experiments.lib import toolkit
from experiments.lib.toolkit import fmt, table

ALL = "all"
METRICS = ("roofline_fraction", "target_only_over_transformers", "best_speculative_over", "worst_category_best_speedup",
           "mean_category_best_speedup", "worst_category_speedup", "forward_cost_ratio", "memory_ratio")
DEFAULT_TARGETS = pathlib.Path(__file__).with_name("targets.json")


def _vsum(vectors) -> list[int]:
    vs = [np.asarray(v, np.int64) for v in vectors if v]
    total = np.zeros(max((len(v) for v in vs), default=0), np.int64)
    for v in vs:
        total[:len(v)] += v
    return total.tolist()


def aggregate(recs: list[dict]) -> dict:
    # a decode time lost in timing noise is stored as null (NaN): the sum is then NaN, and noted
    tok, dec, tot = (sum(math.nan if r[k] is None else r[k] for r in recs) for k in ("new_tokens", "decode_s", "total_s"))
    s = {"n_prompts": sum(r["batch"] for r in recs), "new_tokens": tok, "decode_s": dec,
         "prefill_s_mean": float(np.mean([r["prefill_s"] for r in recs])),
         "tokens_per_s": tok / dec if dec > 0 else math.nan, "e2e_tokens_per_s": tok / tot if tot > 0 else math.nan,
         "compile_s": sum(r.get("compile_s", 0.0) for r in recs),
         "compiles_during_timing": sum(r.get("compiles_during_timing", 0) for r in recs)}
    if "rounds" in recs[0]:
        acc, test = _vsum(r["accepted_at"] for r in recs), _vsum(r["tested_at"] for r in recs)
        mix = collections.Counter()
        for r in recs:
            mix.update({int(g): n for g, n in r["gamma_rounds"].items()})
        steps, rounds, committed = (sum(r[k] for r in recs) for k in ("loop_rounds", "rounds", "committed"))
        s.update(steps=steps, rounds=rounds, committed=committed, seconds_per_step=dec / steps if steps else math.nan,
                 tokens_per_target_pass=committed / rounds if rounds else math.nan,
                 alpha_hat=sum(acc) / sum(test) if sum(test) else math.nan,
                 per_position_acceptance=[a / t if t else math.nan for a, t in zip(acc, test)],
                 gamma_rounds={g: n for g, n in sorted(mix.items()) if n})
        if "greedy_rows_matching" in recs[0]:
            s["greedy_matches"] = sum(r["greedy_rows_matching"] for r in recs)
    return s


def _expected_pos(acc, g: int) -> float:
    total = run = 1.0
    for j in range(g):
        run *= acc[j] if j < len(acc) and math.isfinite(acc[j]) else 0.0
        total += run
    return total


def predict(s: dict, base: dict, base_all: dict, temp: float, B: int, verify: dict, propose: dict) -> dict:
    """Predicted speedups of one speculative summary (module doc)."""
    t_step = base["seconds_per_step"]
    alpha = s["alpha_hat"] if math.isfinite(s["alpha_hat"]) else 0.0
    try:
        cost = analysis.RoundCost(draft_s=0.0, verify_s={k: v for (b, k), v in verify.items() if b == B},
                                  overhead_s=max(0.0, base_all["seconds_per_step"] - verify[B, 1]))
        time_s = sum(n * (t_step if g == 0 else cost.round_time(g) + propose[s["drafter"], g, temp, B])
                     for g, n in s["gamma_rounds"].items())
    except (KeyError, ValueError):
        return {}
    mix = s["gamma_rounds"]
    n = sum(mix.values())
    e_iid = sum(c * analysis.expected_tokens_per_round(min(max(alpha, 0.0), 1.0), g) for g, c in mix.items())
    e_pos = sum(c * _expected_pos(s["per_position_acceptance"], g) for g, c in mix.items())
    return {"predicted_speedup_iid": e_iid * t_step / time_s, "predicted_speedup_per_position": e_pos * t_step / time_s,
            "predicted_speedup_measured_tokens": s["tokens_per_target_pass"] * t_step / (time_s / n),
            "predicted_round_s": time_s / n, "measured_round_s": s["decode_s"] / s["steps"]}


def summarize(gens: list[dict], verify: dict, propose: dict) -> dict:
    """{(framework, method, temperature, batch, category): summary}."""
    groups = collections.defaultdict(list)
    for r in gens:
        key = (r["framework"], r["method"], r["temperature"], r["batch"])
        groups[key + (ALL,)].append(r)
        if r["category"] != "mixed":
            groups[key + (r["category"],)].append(r)
    sums = {k: {**aggregate(v), "method": k[1], "drafter": v[0]["drafter"], "records": v} for k, v in groups.items()}
    for (fw, method, temp, B, cat), s in sums.items():
        base = sums.get((fw, "target_only", temp, B, cat))
        if base:
            s["speedup"] = s["tokens_per_s"] / base["tokens_per_s"]
        if fw == "specjax" and method != "target_only" and base and "alpha_hat" in s:
            s.update(predict(s, base, sums[fw, "target_only", temp, B, ALL], temp, B, verify, propose))
        if fw == "transformers":
            sj = sums.get(("specjax", "target_only", temp, B, cat))
            spec = [v for k, v in sums.items() if k[:1] == ("specjax",) and k[1] != "target_only"
                    and k[2:] == (temp, B, cat)]
            if method == "target_only" and sj:
                s["specjax_over_this"] = sj["tokens_per_s"] / s["tokens_per_s"]
            elif method != "target_only" and spec:
                best = max(spec, key=lambda v: v["tokens_per_s"])
                s.update(specjax_over_this=best["tokens_per_s"] / s["tokens_per_s"], specjax_best=best["method"])
    for (fw, method, temp, B, cat), s in sums.items():
        per_cat = [v["speedup"] for k, v in sums.items() if k[:4] == (fw, method, temp, B) and k[4] != ALL]
        if cat == ALL and per_cat and "speedup" in s:
            s["speedup_mean_over_categories"] = float(np.mean(per_cat))
    return sums


def rooflines(setup: dict, bw: dict, sums: dict, temp: float) -> dict:
    """Per batch size: bytes of one decode step = weights once + batch x K, V of every layer at
    the mean context (prompt + half the generated tokens of target-only at `temp`); roofline
    tokens/s = batch x bandwidth / bytes; the fraction each framework's target-only reaches."""
    out = {}
    for (fw, method, t, B, cat), s in sums.items():
        if (fw, method, t, cat) != ("specjax", "target_only", temp, ALL):
            continue
        recs = s["records"]
        ctx = float(np.mean([p + n / 2 for r in recs for p, n in zip(r["prompt_tokens"], r["new_tokens_per_row"])]))
        cap = float(np.mean([r["capacity"] for r in recs]))
        step, full = (setup["weight_bytes"] + B * setup["kv_bytes_per_token"] * n for n in (ctx, cap))
        rf = {"batch": B, "mean_context": ctx, "bytes_per_step": step, "roofline_tokens_per_s": B * bw * 1e9 / step,
              "mean_capacity": cap, "roofline_full_cache": B * bw * 1e9 / full}
        for f in ("specjax", "transformers"):
            if (f, "target_only", t, B, ALL) in sums:
                rf[f] = sums[f, "target_only", t, B, ALL]["tokens_per_s"] / rf["roofline_tokens_per_s"]
        out[B] = rf
    return out


def best_per_category(sums: dict, temp: float) -> dict:
    """{category: (speedup, method)} of the fastest speculative method at batch 1."""
    best = {}
    for (fw, method, t, B, cat), s in sums.items():
        if fw == "specjax" and method != "target_only" and t == temp and B == 1 and cat != ALL and "speedup" in s:
            best[cat] = max(best.get(cat, (-1.0, "")), (s["speedup"], method))
    return best


def target_rows(spec: dict, sums, verify, rfs, memory, temps) -> list[list]:
    """[what, measured, holds] per row of the targets file (– where the run lacks the data)."""
    def value(t, temp):
        m, best = t["metric"], best_per_category(sums, temp)
        if m == "roofline_fraction":
            return [("", rfs.get(1, {}).get("specjax"), "pct")]
        if m == "target_only_over_transformers":
            return [("", sums.get(("transformers", "target_only", temp, 1, ALL), {}).get("specjax_over_this"), "x")]
        if m == "best_speculative_over":
            return [("", sums.get(("transformers", t["method"], temp, 1, ALL), {}).get("specjax_over_this"), "x")]
        if m == "worst_category_best_speedup" and best:
            (lo, lo_m), lo_c = min((v, c) for c, v in best.items())
            return [(f" (lowest: {lo_c}, {lo_m}; {sum(v >= t['min'] for v, _ in best.values())}/{len(best)} reach it)",
                     lo, "x")]
        if m == "mean_category_best_speedup" and best:
            return [("", float(np.mean([v for v, _ in best.values()])), "x")]
        if m == "worst_category_speedup":
            rows = collections.defaultdict(list)
            for (fw, meth, tt, B, cat), s in sums.items():
                if fw == "specjax" and meth.startswith(t["methods"]) and tt == temp and B == 1 and cat != ALL:
                    rows[meth].append((s["speedup"], cat))
            return [(f" ({meth}; worst: {min(v)[1]})", min(v)[0], "x") for meth, v in sorted(rows.items())]
        if m == "forward_cost_ratio" and (1, t["k"]) in verify:
            return [("", verify[1, t["k"]] / verify[1, 1], "x")]
        if m == "memory_ratio" and memory:
            return [("", memory["ratio"], "x")]
        return [("", None, "x")] if m != "worst_category_speedup" else []

    out = []
    for t in spec["targets"]:
        if t["metric"] not in METRICS or ("min" in t) == ("max" in t):
            raise ValueError(f"targets: {t} needs a metric in {METRICS} and one of min / max")
        for temp in (temps if t.get("per_temperature") else [min(temps)]):
            for note, v, kind in value(t, temp):
                ok = None if v is None else (v > t["min"] if t.get("strict") else v >= t["min"]) if "min" in t \
                    else v <= t["max"]
                what = t["what"] + (f" (T={fmt(temp, 1)})" if t.get("per_temperature") else "") + note
                out.append([what, fmt(v, 1, pct=True) if kind == "pct" else (fmt(v) + "x" if v is not None else "–"),
                            "–" if ok is None else ("yes" if ok else "**no**")])
    return out


def forward_curves(forward_cost_records: list[dict], layers: str) -> dict:
    """{model: (layout name, {(batch, k): median s})} of the target's k-token forwards: "target"
    (the run's layout) first, then the same target in each of ``cost_layers``."""
    curves = {}
    for r in sorted(forward_cost_records, key=lambda r: r["model"] != "target"):
        if r["model"].startswith("target"):
            name = r.get("layers", layers) if r["model"] != "target" else layers
            curves.setdefault(r["model"], (name, {}))[1][r["batch"], r["k"]] = r["median_s"]
    return curves


def render(records: list[dict], targets: dict | None) -> tuple[str, dict]:
    by = collections.defaultdict(list)
    for r in records:
        by[r["kind"]].append(r)
    prov, setup, bw = records[0]["provenance"], by["setup"][0], by["bandwidth"][0]
    c = prov["config"]
    verify = {(r["batch"], r["k"]): r["median_s"] for r in by["forward_cost"] if r["model"] == "target"}
    propose = {(r["drafter"], r["gamma"], r["temperature"], r["batch"]): r["median_s"] for r in by["draft_cost"]}
    sums = summarize(by["generation"], verify, propose)
    temps, Bs = sorted({k[2] for k in sums}), sorted({k[3] for k in sums})
    rfs = rooflines(setup, bw["gb_per_s"], sums, temps[0])
    memory = by["memory"][0] if by["memory"] else None
    out = ["# specjax speed benchmark", ""] + toolkit.provenance_lines(prov) + [
        f"- workload: {len(prov['prompt_ids'])} prompts (held-out Spec-Bench question ids {prov['prompt_ids']}), "
        f"batch sizes {c['batch_sizes']}, {c['dtype']}, layers `{c['layers']}`, max_new_tokens {c['max_new_tokens']}"
        f", stop at EOS: {not c['ignore_eos']}, repeats {c['repeats']} (medians), temperatures {c['temperatures']}, "
        f"prompts and cache capacity padded to multiples of {c['pad_multiple']}, verifier {c['verifier']}", "",
        "Every configuration runs once untimed per compiled shape (its trace + compile seconds: *compile s*), then "
        "`repeats` timed runs; *tokens/s* = generated tokens / decode seconds (the prefill and the decoding "
        "that continues from it timed apart), summed over prompts; *e2e* includes the prefill. See `experiments/bench_speed/README.md`.", ""]
    if prov.get("random_weights"):
        out += ["> **Random weights**: acceptance and measured speedups say nothing about a trained model; read "
                "them as cost measurements (the oracle's round is the per-round cost of verification).", ""]
    if targets:
        out += [f"## 0. {targets['title']} in this run", "",
                table(["target", "measured", "holds"], target_rows(targets, sums, verify, rfs, memory, temps)), ""]

    def rows(fw, method_filter):
        return [(k, s) for k, s in sorted(sums.items(), key=lambda kv: (kv[0][2], kv[0][3], kv[0][0] != "specjax",
                                                                         kv[0][1]))
                if k[0] in fw and method_filter(k[1]) and k[4] == ALL]

    out += ["## 1. Target-only decoding (and transformers)", "", table(
        ["framework", "method", "T", "batch", "tokens/s", "e2e tokens/s", "prefill ms (mean)", "new tokens",
         "compile s", "speedup vs own target-only", "specjax ÷ this"],
        [[k[0], k[1], fmt(k[2], 1), k[3], fmt(s["tokens_per_s"], 1), fmt(s["e2e_tokens_per_s"], 1),
          fmt(1e3 * s["prefill_s_mean"], 1), s["new_tokens"], fmt(s["compile_s"], 1) if k[0] == "specjax" else "–",
          fmt(s.get("speedup")) if k[1] != "target_only" else "–",
          fmt(s.get("specjax_over_this", 1.0 if k[0] == "specjax" else None))]
         for k, s in rows(("specjax", "transformers"), lambda m: m == "target_only" or m in (
             "prompt_lookup", "assisted_distilled"))]), "",
        "*specjax ÷ this*: specjax target-only ÷ this on target-only rows; specjax's fastest speculative method "
        "÷ this on transformers' assisted rows.", ""]

    out += ["## 2. Memory roofline of one target decode step", "", f"Bandwidth: {bw['method']}: " + ", ".join(
        f"{n} {fmt(v, 1)} GB/s" for n, v in bw["probes"].items()) + f"; the roofline uses the best, "
        f"{fmt(bw['gb_per_s'], 1)} GB/s. Weights {setup['weight_bytes'] / 1e6:.1f} MB (a tied head once), "
        f"K and V {setup['kv_bytes_per_token']} bytes per context token.", "", table(
            ["batch", "mean context", "bytes per step", "roofline tokens/s", "specjax", "transformers",
             "roofline over the whole capacity (mean slots)"],
            [[B, fmt(r["mean_context"], 1), f"{r['bytes_per_step'] / 1e6:.1f} MB", fmt(r["roofline_tokens_per_s"], 1),
              fmt(r.get("specjax"), 1, pct=True), fmt(r.get("transformers"), 1, pct=True),
              f"{fmt(r['roofline_full_cache'], 1)} ({fmt(r['mean_capacity'], 0)})"]
             for B, r in sorted(rfs.items())]), ""]

    fc = [r for r in by["forward_cost"] if r["model"] == "target"]
    curves = forward_curves(by["forward_cost"], c["layers"])
    if fc:
        ks = sorted({r["k"] for r in fc})
        out += ["## 3. Cost of a k-token forward", "",
                f"Jitted `apply` of k tokens per row against a cache of {fc[0]['capacity']} slots holding "
                f"{fc[0]['context']} tokens, logits only; median of {c['cost_iters']} calls after a warm-up. "
                "ms (÷ k = 1).", "",
                table(["batch", "layers"] + [f"k={k}" for k in ks], [[B, f"`{name}`" + (" (this run's)" if m == "target" else "")] + [
                    f"{fmt(1e3 * curve[B, k])} ({fmt(curve[B, k] / curve[B, 1])})" if (B, k) in curve else "–"
                    for k in ks] for B in Bs for m, (name, curve) in curves.items()]), ""]
        drows = [[f"`{r['model']}` 1-token forward", "–", r["batch"], fmt(1e3 * r["median_s"]),
                  fmt(r["median_s"] / verify[r["batch"], 1], 3)] for r in by["forward_cost"]
                 if not r["model"].startswith("target")]
        drows += [[f"`{r['drafter']}.propose`, gamma {r['gamma']}", fmt(r["temperature"], 1), r["batch"],
                   fmt(1e3 * r["median_s"]), fmt(r["median_s"] / r["gamma"] / verify[r["batch"], 1], 3)]
                  for r in by["draft_cost"]]
        if drows:
            out += [table(["draft cost", "T", "batch", "ms", "per draft token ÷ target 1-token forward"], drows), ""]
    if by["prefill_cost"]:
        pre = {(r["layers"], r["k"]): r["median_s"] for r in by["prefill_cost"]}
        names, pks = list(dict.fromkeys(r["layers"] for r in by["prefill_cost"])), sorted({k for _, k in pre})
        out += ["Prompt chunks: `specjax.models.prefill` of a k-token prompt into a fresh cache (one chunk, batch 1, "
                "no logits), ms (tokens/s).", "",
                table(["layers"] + [f"k={k}" for k in pks],
                      [[f"`{n}`"] + [f"{fmt(1e3 * pre[n, k])} ({fmt(k / pre[n, k], 0)})" if (n, k) in pre else "–"
                                     for k in pks] for n in names]), ""]

    out += ["## 4. Speculative decoding, all prompts", "",
            "Speedup over specjax target-only decoding of the same prompts, temperature and batch size. *pred.*: "
            "the cost model's speedup (*iid* from alpha_hat, *pos* from the per-position acceptance, *cost* from the "
            "measured tokens per round). *greedy = target-only*: rows whose greedy tokens equal target-only's.", "",
            table(["method", "T", "batch", "tokens/s", "speedup", "mean of category speedups", "pred. iid", "pred. pos",
                   "pred. cost", "tokens / target pass", "alpha_hat", "acceptance per position", "round ms (pred.)",
                   "compile s", "greedy = target-only"],
                  [[k[1], fmt(k[2], 1), k[3], fmt(s["tokens_per_s"], 1), fmt(s.get("speedup")),
                    fmt(s.get("speedup_mean_over_categories")), fmt(s.get("predicted_speedup_iid")),
                    fmt(s.get("predicted_speedup_per_position")), fmt(s.get("predicted_speedup_measured_tokens")),
                    fmt(s.get("tokens_per_target_pass")), fmt(s.get("alpha_hat"), 3),
                    " ".join(fmt(a) for a in s["per_position_acceptance"]),
                    f"{fmt(1e3 * s['decode_s'] / s['steps'], 1)} "
                    f"({fmt(1e3 * s.get('predicted_round_s', math.nan), 1)})",
                    fmt(s["compile_s"], 1),
                    f"{s['greedy_matches']}/{s['n_prompts']}" if "greedy_matches" in s else "–"]
                   for k, s in rows(("specjax",), lambda m: m != "target_only")]), ""]

    cats = sorted({k[4] for k in sums if k[4] != ALL and k[3] == 1})
    if cats:
        cols = [(k[1], k[2]) for k, _ in rows(("specjax",), lambda m: m != "target_only") if k[3] == 1]
        out += ["## 5. Speedup per Spec-Bench category (batch 1)", "",
                "measured (predicted iid) [tokens per target pass].", "",
                table(["category", f"target-only tokens/s (T={fmt(temps[0], 1)})"] + [f"{m} T={fmt(t, 1)}"
                                                                                     for m, t in cols],
                      [[cat, fmt(sums.get(("specjax", "target_only", temps[0], 1, cat), {}).get("tokens_per_s"), 1)] +
                       [(lambda s: f"{fmt(s.get('speedup'))} ({fmt(s.get('predicted_speedup_iid'))}) "
                                   f"[{fmt(s.get('tokens_per_target_pass'))}]" if s else "–")(
                           sums.get(("specjax", m, t, 1, cat))) for m, t in cols] for cat in cats + [ALL]]), ""]
        hf = [[k[1], k[4], fmt(k[2], 1), fmt(s["tokens_per_s"], 1), fmt(s.get("speedup")),
               fmt(s.get("specjax_over_this"))] for k, s in sorted(sums.items())
              if k[0] == "transformers" and k[1] != "target_only" and k[3] == 1]
        if hf:
            out += ["transformers assisted generation: speedup over transformers `generate`; specjax's fastest "
                    "speculative method ÷ it.", "",
                    table(["method", "category", "T", "tokens/s", "speedup", "specjax best ÷ this"], hf), ""]

    if memory:
        m, mib = memory, (lambda b: "–" if b is None else f"{b / 2 ** 20:.1f} MiB")
        out += ["## 6. Peak resident memory of a generation-only process", "",
                f"Own process (`memory.py`): {m['num_prompts']} prompt(s) x {m['max_new_tokens']} new tokens, greedy, "
                f"target-only then speculative ({m['drafter']}, gamma {m['gamma']}), layers `{m['layers']}`; VmHWM "
                f"reset per stage: {m['peak_reset_works']}.", "",
                table(["quantity", "value"], [
                    ["RSS after import (baseline)", mib(m["rss_after_import"])],
                    [f"peak RSS (stage `{m['peak_stage']}`) above the baseline", mib(m["peak_above_import"])],
                    ["target params / draft's own params",
                     f"{mib(m['target_param_bytes'])} / {mib(m['draft_param_bytes'])}"],
                    [f"target KV cache / drafter state at capacity {m['capacity']}",
                     f"{mib(m['target_kv_bytes'])} / {mib(m['draft_state_bytes'])}"],
                    ["ratio = peak above baseline ÷ (weights + KV)", fmt(m["ratio"])],
                    ["at the end: live jax arrays", mib(m["live_array_bytes"])],
                    ["at the end: free heap kept by the allocator (`malloc_trim`)", mib(m["free_heap_at_end"])],
                    ["at the end: jax's compiled programs (`jax.clear_caches`)", mib(m["compiled_programs_at_end"])]]),
                "", table(["stage", "RSS above baseline at its end", "its peak above baseline", "compile s"],
                          [[s["stage"], mib(s["rss"] - m["rss_after_import"]),
                            mib(s["peak_rss"] - m["rss_after_import"]), fmt(s.get("compile_s"), 1)]
                           for s in m["stages"]]), ""]

    if c.get("alphas") and by["draft_cost"]:
        prows = []
        for B in Bs:
            base = sums.get(("specjax", "target_only", temps[0], B, ALL))
            for r in (r for r in by["draft_cost"] if r["batch"] == B and r["temperature"] == temps[0]):
                vs = {k: v for (b, k), v in verify.items() if b == B}
                if not base or r["gamma"] + 1 not in vs:
                    continue
                vs[1] = base["seconds_per_step"]
                rc = analysis.RoundCost(draft_s=r["median_s"] / r["gamma"], verify_s=vs,
                                        overhead_s=max(0.0, base["seconds_per_step"] - verify[B, 1]))
                prows += [[B, r["drafter"], r["gamma"], fmt(a, 2), fmt(rc.predicted_speedup(a, r["gamma"], vs[1])),
                           f"{rc.best_gamma(a)} ({fmt(rc.predicted_speedup(a, rc.best_gamma(a), vs[1]))})"]
                          for a in c["alphas"]]
        out += ["## 7. Predicted speedup at assumed acceptance rates", "",
                "The cost model on this run's measured costs (target step, k-token forwards, propose) at acceptance "
                "alpha; best gamma over the measured k.", "",
                table(["batch", "drafter", "gamma", "alpha", "predicted speedup", "best gamma (speedup)"], prows), ""]

    notes = [f"{s['compiles_during_timing']} compilation(s) inside timed runs of {k[1]} (T={k[2]}, batch {k[3]})"
             for k, s in sums.items() if k[4] == ALL and s["compiles_during_timing"]]
    notes += [f"decode time lost in timing noise for {k[1]} (T={k[2]}, batch {k[3]})" for k, s in sums.items()
              if k[4] == ALL and not s["decode_s"] > 0]
    load, cpus = prov["machine"].get("loadavg_at_start"), prov["machine"].get("cpus_usable") or 1
    if load and load[0] > 0.5 * cpus:
        notes.append(f"busy machine at the start (load {load[0]:.1f} on {cpus} CPUs): timings are unreliable")
    if by["run"]:
        r = by["run"][0]
        notes.append(f"wall time {r['wall_s']:.0f} s; load average at the end {r['loadavg_at_end']}" + (
            f"; peak device memory {r['peak_device_bytes'] / 2 ** 30:.2f} GiB" if r.get("peak_device_bytes") else ""))
    out += ["## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n", {"sums": sums, "verify": verify, "rooflines": rfs, "curves": curves,
                                    "title": f"{setup.get('layers', c['layers'])} | {prov['machine'].get('cpu_model', '')}"
                                             f" | {(prov.get('git_commit') or '')[:7]}"}


def plot(path, sums, curves, title: str = "") -> bool:
    """plots.png: the k-token forward curves (ms) per layout and batch size; tokens/s per method
    (batch 1, all prompts)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in curves.values():
        for B in sorted({b for b, _ in curve}):
            ks = sorted(k for bb, k in curve if bb == B)
            a.plot(ks, [1e3 * curve[B, k] for k in ks], "o-", label=f"{name}, batch {B}")
    a.set(xlabel="k tokens", ylabel="ms per forward", title="k-token forward", ylim=(0, None))
    a.legend()
    bars = [(f"{k[0]} {k[1]} T={k[2]:g}", s["tokens_per_s"]) for k, s in sorted(sums.items())
            if k[3] == 1 and k[4] == ALL]
    b.barh([n for n, _ in bars], [v for _, v in bars])
    b.set(xlabel="tokens/s", title="all prompts, batch 1")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write(path, targets=DEFAULT_TARGETS, out=None) -> str:
    """Renders `path` (a results.jsonl) to README.md (+ plots.png) in `out` (default: beside it);
    returns a console summary."""
    path = pathlib.Path(path)
    out = pathlib.Path(out or path.parent)
    out.mkdir(parents=True, exist_ok=True)
    md, res = render(toolkit.read_jsonl(path), json.loads(pathlib.Path(targets).read_text()) if targets else None)
    (out / "README.md").write_text(md, encoding="utf-8")
    plotted = plot(out / "plots.png", res["sums"], res["curves"], res["title"])
    lines = [f"{k[0]:>12} {k[1]:<20} T={k[2]:g} batch {k[3]}: {s['tokens_per_s']:8.1f} tokens/s"
             + (f", speedup {s['speedup']:.2f}x" if k[1] != "target_only" and "speedup" in s else "")
             for k, s in sorted(res["sums"].items()) if k[4] == ALL]
    lines += [f"roofline (batch {B}): {r['roofline_tokens_per_s']:.1f} tokens/s; specjax at "
              f"{fmt(r.get('specjax'), 1, pct=True)}" for B, r in res["rooflines"].items()]
    return "\n".join(lines + [f"wrote {out / 'README.md'}" + (f" and {out / 'plots.png'}" if plotted else "")])


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("usage: python -m experiments.bench_speed.report RESULTS.jsonl [--targets=] [--out=]")
    print(write(argv[1], flags.FLAGS.targets, flags.FLAGS.out))


if __name__ == "__main__":
    flags.DEFINE_string("targets", str(DEFAULT_TARGETS), "targets file (JSON); empty: no targets section")
    flags.DEFINE_string("out", None, "output directory (default: the JSONL's)")
    app.run(main)
