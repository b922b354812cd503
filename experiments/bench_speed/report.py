"""The Markdown summary: provenance header, then one table per measurement."""

from __future__ import annotations

import math

from experiments.bench_speed.summarize import ALL


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


def _by(summaries, **match):
    return [s for s in summaries if all(s.get(k) == v for k, v in match.items())]


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

    # 1. target-only
    out.append("## 1. Target-only decoding (specjax vs transformers)")
    rows = []
    for t in temps:
        for fw, method, label in (("specjax", "target_only", "specjax `autoregressive_generate` (jitted loop)"),
                                  ("transformers", "target_only", "transformers `generate`"),
                                  ("transformers", "prompt_lookup", "transformers `generate`, prompt lookup")):
            for s in _by(sums, framework=fw, method=method, temperature=t, category=ALL):
                rel = "1.00" if fw == "specjax" else _f(s.get("specjax_target_only_over_transformers"))
                rows.append([label, _f(t, 1), _f(s["tokens_per_s"], 1), _f(s["e2e_tokens_per_s"], 1),
                             _f(1e3 * s["prefill_s_mean"], 1), s["new_tokens"],
                             _f(s["compile_s"], 1) if fw == "specjax" else "–",
                             _f(s.get("speedup")) if method != "target_only" else "–",
                             rel if method == "target_only" else "–"])
    out.append(markdown_table(["method", "T", "tokens/s", "e2e tokens/s", "prefill ms (mean)", "new tokens", "compile s",
                       "speedup vs own target-only", "specjax ÷ this"], rows))
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
    for t in temps:
        for s in sorted(_by(sums, framework="transformers", method="prompt_lookup", temperature=t),
                        key=lambda s: (s["category"] == ALL, s["category"])):
            hf_rows.append([s["category"], _f(t, 1), _f(s["tokens_per_s"], 1), _f(s.get("speedup"))])
    if hf_rows:
        out.append("transformers prompt lookup, speedup over transformers `generate`:")
        out.append("")
        out.append(markdown_table(["category", "T", "tokens/s", "speedup"], hf_rows))
        out.append("")
    notes = results.get("notes") or []
    if notes:
        out.append("## Notes")
        out.extend(f"- {n}" for n in notes)
        out.append("")
    return "\n".join(out)
