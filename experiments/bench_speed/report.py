"""The Markdown summary: provenance header, then one table per measurement."""

from __future__ import annotations

import math

from experiments.bench_speed.summarize import ALL, ASSISTED_TARGET


def _f(x, digits=2, pct=False):
    if x is None:
        return "–"
    if isinstance(x, float) and not math.isfinite(x):
        return "–"
    if pct:
        return f"{100 * x:.{digits}f}%"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance_header(prov: dict) -> str:
    m = prov["machine"]
    s = prov["settings"]
    dirty = prov.get("git_dirty")
    lines = [
        f"- date (UTC): {prov['date_utc']}; command: `{prov['command']}`",
        f"- git commit: `{prov['git_commit']}`" + (" (working tree dirty)" if dirty else "" if dirty is not None
                                                    else " (dirty state unknown)"),
        f"- model: `{prov['model']}`, weights file `{prov['model_file']}`, sha256 `{prov['model_sha256']}`"
        f" ({prov['model_notes']})",
        f"- machine: {m['cpu_model']}, {m['cpus_usable']} usable of {m['cpu_count']} CPUs"
        + (f" (cgroup quota {m['cgroup_cpu_quota']:g} CPUs)" if m.get("cgroup_cpu_quota") else "")
        + f", {m['mem_total_gib']} GiB; {m['platform']}; load average at start {m.get('loadavg_at_start')}",
        f"- versions: python {m['python']}, jax {m['jax']} (jaxlib {m['jaxlib']}, backend {m['jax_backend']}), "
        f"flax {m['flax']}, numpy {m['numpy']}, torch {m['torch']}, transformers {m['transformers']}",
        f"- prompts: {len(prov['prompt_ids'])} held-out Spec-Bench questions, ids {prov['prompt_ids']}",
        f"- settings: batch 1, {s['dtype']}, max_new_tokens {s['max_new_tokens']}, repeats {s['repeats']} "
        f"(medians), temperatures {s['temperatures']}, stop at EOS: {not s['ignore_eos']}, prompts padded to a "
        f"multiple of {s['pad_multiple']} (cache capacity bucketed likewise), verifier {s['verifier']}, "
        f"torch threads {s['torch_threads']}",
    ]
    return "\n".join(lines)


HF_ASSISTED = ("prompt_lookup", "assisted_distilled")
HF_LABELS = {"prompt_lookup": "transformers `generate`, prompt lookup",
             "assisted_distilled": "transformers `generate`, assisted by the distilled draft (HF export)"}
MiB = 2 ** 20


def assisted_section(sums, temps) -> list[str]:
    """Section 6: specjax's fastest speculative method vs each transformers assisted method, all prompts."""
    rows = []
    for t in temps:
        for method in HF_ASSISTED:
            for s in _by(sums, framework="transformers", method=method, temperature=t, category=ALL):
                if "specjax_best_speculative_over_this" not in s:
                    continue
                rows.append([_f(t, 1), method, _f(s["tokens_per_s"], 1), s["specjax_best_speculative_method"],
                             _f(s["specjax_best_speculative_tokens_per_s"], 1),
                             _f(s["specjax_best_speculative_over_this"]),
                             "yes" if s["assisted_target_holds"] else "no"])
    if not rows:
        return []
    target = ASSISTED_TARGET
    return ["## 6. specjax speculative decoding vs transformers assisted generation",
            f"Same prompts and temperature; tokens/s over all prompts. Target (issue 6): specjax at least "
            f"{_f(target, 1)}x transformers' assisted generation.", "",
            markdown_table(["T", "transformers method", "tokens/s", "specjax fastest speculative", "tokens/s",
                            "specjax ÷ transformers", f">= {_f(target, 1)}x"], rows), ""]


def memory_section(mem: dict | None) -> list[str]:
    """Section 7: the peak resident memory of a generation-only process (memory.py)."""
    if not mem:
        return []
    mib = lambda b: "–" if b is None else f"{b / MiB:.1f} MiB"   # noqa: E731
    rows = [
        ["RSS right after import (baseline)", mib(mem["rss_after_import"])],
        [f"peak RSS (during stage `{mem['peak_stage']}`)", mib(mem["peak_rss"])],
        ["peak above the baseline", mib(mem["peak_above_import"])],
        ["target params (each buffer once)", mib(mem["target_param_bytes"])],
        [f"draft params not shared with the target ({mem['drafter']})", mib(mem["draft_param_bytes"])],
        [f"target KV cache at capacity {mem['capacity']}", mib(mem["target_kv_bytes"])],
        ["drafter state at that capacity (draft KV cache)", mib(mem["draft_state_bytes"])],
        ["weights + KV", mib(mem["reference_bytes"])],
        ["ratio = peak above baseline ÷ (weights + KV)", _f(mem["ratio"])],
        [f"target: ratio <= {_f(mem['target_ratio'], 1)}", "holds" if mem["holds"] else "**missed**"],
        ["gap: peak above baseline - target x (weights + KV)",
         mib(mem["peak_above_import"] - int(mem["target_ratio"] * mem["reference_bytes"]))],
        ["at the end: bytes of live jax arrays", mib(mem["live_array_bytes"])],
        ["at the end: free heap kept by the allocator (released by `malloc_trim`)", mib(mem["free_heap_at_end"])],
        ["at the end: jax's traced / compiled programs (released by `jax.clear_caches`)",
         mib(mem["compiled_programs_at_end"])],
        ["at the end, after releasing both: RSS above baseline (÷ weights + KV)",
         f"{mib(mem['rss_at_end_without_both'] - mem['rss_after_import'])} "
         f"({_f((mem['rss_at_end_without_both'] - mem['rss_after_import']) / mem['reference_bytes'])})"],
    ]
    stage_rows = [[s["stage"], mib(s["rss"] - mem["rss_after_import"]), mib(s["peak_rss"] - mem["rss_after_import"]),
                   mib(s["rss_anon"]), mib(s["rss_file"]), _f(s.get("compile_s"), 1)] for s in mem["stages"]]
    return ["## 7. Peak resident memory of a generation-only process",
            f"`python -m experiments.bench_speed.memory` in its own process: {mem['num_prompts']} prompt(s) x "
            f"{mem['max_new_tokens']} new tokens, greedy, target-only then speculative ({mem['drafter']}, gamma "
            f"{mem['gamma']}), layers `{mem['layers']}`. VmRSS / VmHWM from /proc/self/status; the peak is reset "
            f"at each stage's start (reset {'worked' if mem['peak_reset_works'] else 'refused: peaks cumulative'}).",
            "", markdown_table(["quantity", "value"], rows), "",
            markdown_table(["stage", "RSS above baseline at its end", "peak above baseline", "RssAnon", "RssFile",
                            "compile s"], stage_rows), ""]


def _by(summaries, **match):
    return [s for s in summaries if all(s.get(k) == v for k, v in match.items())]


def _x(r) -> str:
    return "–" if r is None else f"{_f(r)}x"


def target_rows(results: dict) -> list[list]:
    """Issue 6's targets against this run: [target, measured, holds] rows (missing data: '–')."""
    sums = results["summaries"]
    temps = sorted({s["temperature"] for s in sums})
    yes = lambda ok: "–" if ok is None else ("yes" if ok else "**no**")   # noqa: E731
    rows = []
    rf = results.get("roofline") or {}
    frac = rf.get("specjax_fraction")
    rows.append(["target-only greedy >= 60% of the roofline", _f(frac, 1, pct=True),
                 yes(None if frac is None else frac >= 0.6)])
    for t in temps:
        for s in _by(sums, framework="transformers", method="target_only", temperature=t, category=ALL):
            r = s.get("specjax_target_only_over_transformers")
            rows.append([f"target-only >= 3x transformers `generate` (T={_f(t, 1)})", _x(r),
                         yes(None if r is None else r >= 3.0)])
    cats = sorted({s["category"] for s in sums if s["category"] != ALL})
    for t in temps:
        spec = [s for s in _by(sums, framework="specjax", temperature=t) if s["method"] != "target_only"]
        if not spec:
            continue
        best = {}
        for c in cats:
            ss = [s for s in spec if s["category"] == c and s.get("speedup") is not None]
            if ss:
                b = max(ss, key=lambda s: s["speedup"])
                best[c] = (b["speedup"], b["method"])
        if best:
            n2 = sum(v >= 2.0 for v, _ in best.values())
            top = max(best.items(), key=lambda kv: kv[1][0])
            rows.append([f"best drafter per category >= 2x own target-only (T={_f(t, 1)})",
                         f"{n2}/{len(best)} categories; highest {_f(top[1][0])}x ({top[0]}, {top[1][1]})",
                         yes(n2 == len(best))])
            mean_best = sum(v for v, _ in best.values()) / len(best)
            rows.append([f"mean over categories of the best drafter's speedup > 1.5x (T={_f(t, 1)})",
                         f"{_f(mean_best)}x", yes(mean_best > 1.5)])
        for method in sorted({s["method"] for s in spec if s["method"].startswith("adaptive")}):
            per_cat = [(s["speedup"], s["category"]) for s in spec
                       if s["method"] == method and s["category"] != ALL and s.get("speedup") is not None]
            if per_cat:
                worst = min(per_cat)
                rows.append([f"{method}: no category below 0.95x target-only (T={_f(t, 1)})",
                             f"worst {_f(worst[0])}x ({worst[1]})", yes(worst[0] >= 0.95)])
        for method in HF_ASSISTED:
            for s in _by(sums, framework="transformers", method=method, temperature=t, category=ALL):
                r = s.get("specjax_best_speculative_over_this")
                rows.append([f"best speculative >= 2x transformers {method} (T={_f(t, 1)})", _x(r),
                             yes(None if r is None else r >= ASSISTED_TARGET)])
    fc = results.get("forward_costs") or {}
    tgt = fc.get("target") or {}
    if 1 in tgt and 5 in tgt:
        r = tgt[5]["median_s"] / tgt[1]["median_s"]
        rows.append(["5-token forward (verify at gamma 4) <= 1.5x a 1-token step", _x(r), yes(r <= 1.5)])
    mem = results.get("memory")
    if mem:
        rows.append(["peak RSS above post-import <= 1.5x weights + KV", f"{_f(mem['ratio'])}x",
                     yes(mem["ratio"] <= mem["target_ratio"])])
    return rows


def targets_section(results: dict) -> list[str]:
    rows = target_rows(results)
    return ["## 0. Issue 6 targets in this run",
            "Measured in this run (details in the sections below; causes of the misses in "
            "`experiments/bench_speed/PROFILE.md`).", "",
            markdown_table(["target", "measured", "holds"], rows), ""]


def render(results: dict) -> str:
    prov = results["provenance"]
    sums = results["summaries"]
    temps = sorted({s["temperature"] for s in sums})
    out = ["# specjax speed benchmark", "", provenance_header(prov), ""]
    out.append("Timing: every configuration runs once untimed per compiled shape (warm-up; its trace + "
               "compile seconds are the *compile s* column), then `repeats` timed runs per prompt, median "
               "kept. *tokens/s* = generated tokens / decode seconds (decode = full generation - prefill, "
               "each timed separately), summed over prompts; *e2e* includes the prefill. See "
               "`experiments/bench_speed/README.md`.")
    out.append("")
    out.extend(targets_section(results))

    # 1. target-only
    out.append("## 1. Target-only decoding (specjax vs transformers)")
    rows = []
    for t in temps:
        for fw, method, label in (("specjax", "target_only", "specjax `autoregressive_generate` (jitted loop)"),
                                  ("transformers", "target_only", "transformers `generate`"),
                                  *((("transformers", m, HF_LABELS[m]) for m in HF_ASSISTED))):
            for s in _by(sums, framework=fw, method=method, temperature=t, category=ALL):
                if fw == "specjax":
                    rel = "1.00"
                elif method == "target_only":
                    rel = _f(s.get("specjax_target_only_over_transformers"))
                else:
                    rel = _f(s.get("specjax_best_speculative_over_this"))
                rows.append([label, _f(t, 1), _f(s["tokens_per_s"], 1), _f(s["e2e_tokens_per_s"], 1),
                             _f(1e3 * s["prefill_s_mean"], 1), s["new_tokens"],
                             _f(s["compile_s"], 1) if fw == "specjax" else "–",
                             _f(s.get("speedup")) if method != "target_only" else "–", rel])
    out.append(markdown_table(["method", "T", "tokens/s", "e2e tokens/s", "prefill ms (mean)", "new tokens", "compile s",
                       "speedup vs own target-only", "specjax ÷ this"], rows))
    out.append("")
    out.append("*specjax ÷ this*: specjax target-only tokens/s ÷ this row's on the target-only rows; on the "
               "assisted rows, specjax's fastest speculative method (section 4) ÷ this row (section 6).")
    out.append("")

    # 2. roofline
    rf = results.get("roofline")
    bw = results.get("bandwidth")
    if rf and bw:
        out.append("## 2. Memory roofline of one target decode step")
        out.append(f"Bandwidth probe: {bw['method']}. Measured: "
                   + ", ".join(f"{t} thread(s) {_f(v['gb_per_s'], 1)} GB/s" for t, v in bw["threads"].items())
                   + f"; the roofline uses the best, {_f(rf['bandwidth_gb_per_s'], 1)} GB/s.")
        out.append("")
        rows = [
            ["float32 weight bytes (tied head once)", f"{rf['weight_bytes'] / 1e6:.1f} MB"],
            ["KV bytes per context token", f"{rf['kv_bytes_per_context_token']}"],
            ["mean context (prompt + half the generated tokens, greedy target-only)",
             _f(rf["mean_context_tokens"], 1)],
            ["bytes per decode step", f"{rf['bytes_per_decode_step'] / 1e6:.1f} MB"],
            ["roofline tokens/s", _f(rf["roofline_tokens_per_s"], 1)],
        ]
        for label, key in (("specjax target-only greedy", "specjax_fraction"),
                           ("transformers greedy", "transformers_fraction")):
            if rf.get(key) is not None:
                rows.append([f"{label}: fraction of roofline", _f(rf[key], 1, pct=True)])
        if rf.get("roofline_tokens_per_s_full_cache") is not None:
            rows.append(["roofline counting the full cache capacity specjax attends over "
                         f"(mean {_f(rf['mean_capacity_slots'], 0)} slots)",
                         _f(rf["roofline_tokens_per_s_full_cache"], 1)])
        out.append(markdown_table(["quantity", "value"], rows))
        out.append("")

    # 3. forward costs
    fc = results.get("forward_costs")
    if fc:
        out.append("## 3. Cost of a k-token forward")
        out.append(f"Jitted `apply` of k tokens against a cache of {fc['capacity']} slots holding {fc['context']} "
                   f"tokens; median of {fc['iters']} calls.")
        out.append("")
        base = fc["target"][1]["median_s"]
        rows = [[k, _f(1e3 * v["median_s"], 2), _f(v["median_s"] / base)] for k, v in sorted(fc["target"].items())]
        out.append(markdown_table(["k", "target ms", "relative to k=1"], rows))
        out.append("")
        drows = []
        if fc.get("draft"):
            d1 = fc["draft"][1]["median_s"]
            drows.append([f"early-exit draft ({fc['draft_layers']} layers), 1-token forward", "–",
                          _f(1e3 * d1, 2), _f(d1 / base, 3)])
        for p in fc.get("propose", []):
            drows.append([f"`{p['drafter']}.propose`, gamma {p['gamma']}", _f(p["temperature"], 1),
                          _f(1e3 * p["median_s"], 2), _f(p["median_s"] / p["gamma"] / base, 3)])
        if drows:
            out.append(markdown_table(["draft cost", "T", "ms", "per draft token ÷ target 1-token forward"], drows))
            out.append("")

    # 4. speculative, all prompts
    out.append("## 4. Speculative decoding, all prompts")
    out.append("Speedup over specjax target-only decoding of the same prompts at the same temperature (same run). "
               "*pred.* = cost-model speedup: *iid* from alpha_hat, *pos* from the per-position acceptance, "
               "*cost* from the measured tokens per round (isolates the cost model). Acceptance per draft "
               "position j = accepted_at[j] / tested_at[j] summed over prompts.")
    out.append("")
    rows = []
    for t in temps:
        for s in _by(sums, framework="specjax", temperature=t, category=ALL):
            if s["method"] == "target_only":
                continue
            rows.append([s["method"], _f(t, 1), _f(s["tokens_per_s"], 1), _f(s.get("speedup")),
                         _f(s.get("speedup_mean_over_categories")),
                         _f(s.get("predicted_speedup_iid")), _f(s.get("predicted_speedup_per_position")),
                         _f(s.get("predicted_speedup_measured_tokens")),
                         _f(s.get("tokens_per_target_pass")), _f(s.get("alpha_hat"), 3),
                         " ".join(_f(a) for a in s.get("per_position_acceptance", [])),
                         _f(s["compile_s"], 1),
                         (f"{s['greedy_matches']}/{s['n_prompts']}" if s.get("greedy_matches") is not None
                          else "–")])
    out.append(markdown_table(["method", "T", "tokens/s", "speedup", "mean of category speedups", "pred. iid",
                       "pred. pos", "pred. cost", "tokens / target pass", "alpha_hat",
                       "acceptance per position", "compile s", "greedy = target-only"], rows))
    out.append("")

    # 5. per category
    out.append("## 5. Speedup per Spec-Bench category")
    out.append("measured (predicted iid); tokens per target pass in brackets.")
    out.append("")
    cols = [(s["method"], s["temperature"]) for s in sums
            if s["framework"] == "specjax" and s["category"] == ALL and s["method"] != "target_only"]
    cats = sorted({s["category"] for s in sums if s["category"] != ALL})
    rows = []
    for cat in cats + [ALL]:
        row = [cat]
        base = _by(sums, framework="specjax", method="target_only", temperature=temps[0], category=cat)
        row.append(_f(base[0]["tokens_per_s"], 1) if base else "–")
        for method, t in cols:
            s = _by(sums, framework="specjax", method=method, temperature=t, category=cat)
            if s:
                s = s[0]
                row.append(f"{_f(s.get('speedup'))} ({_f(s.get('predicted_speedup_iid'))}) "
                           f"[{_f(s.get('tokens_per_target_pass'))}]")
            else:
                row.append("–")
        rows.append(row)
    out.append(markdown_table(["category", f"target-only tokens/s (T={_f(temps[0], 1)})"]
                      + [f"{m} T={_f(t, 1)}" for m, t in cols], rows))
    out.append("")
    hf_rows = []
    for method in HF_ASSISTED:
        for t in temps:
            for s in sorted(_by(sums, framework="transformers", method=method, temperature=t),
                            key=lambda s: (s["category"] == ALL, s["category"])):
                hf_rows.append([method, s["category"], _f(t, 1), _f(s["tokens_per_s"], 1), _f(s.get("speedup")),
                                _f(s.get("specjax_best_speculative_over_this"))])
    if hf_rows:
        out.append("transformers assisted generation, speedup over transformers `generate`, and specjax's fastest "
                   "speculative method ÷ it:")
        out.append("")
        out.append(markdown_table(["method", "category", "T", "tokens/s", "speedup", "specjax best ÷ this"], hf_rows))
        out.append("")
    out.extend(assisted_section(sums, temps))
    out.extend(memory_section(results.get("memory")))
    notes = results.get("notes") or []
    if notes:
        out.append("## Notes")
        out.extend(f"- {n}" for n in notes)
        out.append("")
    return "\n".join(out)
