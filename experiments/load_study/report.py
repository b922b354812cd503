"""`results.md` of the load study, from its JSONL alone:
``python -m experiments.load_study.report RESULTS.jsonl``."""
from __future__ import annotations

import sys

from experiments.lib import toolkit


def load_label(kind: str, load: float) -> str:
    return "all at once" if kind == "all at once" else f"{kind} {load:g}"


def _share(counts, labels) -> str:
    total = sum(counts)
    if len(counts) < 2 or not total:
        return "–"
    return ", ".join(f"{g}: {100 * n / total:.0f}%" for g, n in zip(labels, counts) if n)


def _ms(x) -> str:
    return "–" if x is None else toolkit.fmt(1e3 * x, 1)


def aims(records: list[dict]) -> list[list[str]]:
    """The issue's aims, each against this run: rows of (aim, measured, met)."""
    loads = [r for r in records if r["kind"] == "load"]
    live = [r for r in records if r["kind"] == "live"]
    setup = next(r for r in records if r["kind"] == "setup")
    spec_modes = [m for m in setup["modes"] if m != "target-only"]
    base = {(r["slots"], r["arrivals"], r["load"]): r for r in loads if r["mode"] == "target-only"}
    rows = []
    low = min(setup["loads"]) if setup["loads"] else None
    for mode in spec_modes:
        ratios = []
        for r in loads:
            if r["mode"] == mode and r["arrivals"] == "poisson" and r["load"] == low:
                b = base[(r["slots"], "poisson", low)]
                ratios.append((r["slots"], b["inter_token_s_p50"] / r["inter_token_s_p50"]))
        if ratios:
            worst = min(x for _, x in ratios)
            rows.append([f"{mode}: ITL p50 at low load (Poisson, load {low:g}) >= 1.3x better than target-only",
                         ", ".join(f"{s} slots {x:.2f}x" for s, x in ratios), "yes" if worst >= 1.3 else "**no**"])
        tp = [(r, r["throughput_tok_s"] / base[(r["slots"], r["arrivals"], r["load"])]["throughput_tok_s"])
              for r in loads if r["mode"] == mode]
        if tp:
            worst_r, worst = min(tp, key=lambda x: x[1])
            rows.append([f"{mode}: throughput >= 0.98x target-only at every load and slot count",
                         f"lowest {worst:.3f}x ({worst_r['slots']} slots, {load_label(worst_r['arrivals'], worst_r['load'])})",
                         "yes" if worst >= 0.98 else "**no**"])
    offline = {(r["slots"], r["mode"], r["arrivals"], r["load"]): r for r in loads}
    for r in live:
        o = offline.get((r["slots"], r["mode"], r["arrivals"], r["load"]))
        if o:
            ratio = r["throughput_tok_s"] / o["throughput_tok_s"]
            what = "live server over HTTP" if r.get("transport") == "http" else "live scheduler"
            rows.append([f"{what} within 5% of offline throughput ({r['mode']}, {r['slots']} slots, "
                         f"{load_label(r['arrivals'], r['load'])})", f"{ratio:.3f}x", "yes" if abs(ratio - 1) <= 0.05 else "**no**"])
            if r.get("transport") == "http":
                rows.append([f"live server over HTTP: 0 lost ({r['mode']}, {r['slots']} slots, "
                             f"{load_label(r['arrivals'], r['load'])})", f"{r['lost']} lost of {r['requests'] + r['lost']}",
                             "yes" if r["lost"] == 0 else "**no**"])
    return rows


def render(records: list[dict]) -> str:
    setup = next((r for r in records if r["kind"] == "setup"), None)
    loads = [r for r in records if r["kind"] == "load"]
    if setup is None or not loads:
        return "no load records\n"
    cal = {(r["slots"], r["mode"]): r for r in records if r["kind"] == "calibration"}
    cap = {r["slots"]: r for r in records if r["kind"] == "capacity"}
    live = [r for r in records if r["kind"] == "live"]
    lines = ["# Load study: slot-refilling servers with and without speculation", "",
             *toolkit.provenance_lines(setup["provenance"]), "",
             f"Held-out Spec-Bench requests (prompt tokens {min(setup['prompt_tokens'])}-{max(setup['prompt_tokens'])}), "
             f"at most {setup['max_new_tokens']} new tokens each, temperature {setup['temperature']:g}; "
             f"{', '.join(f'{n} requests at {s} slots' for s, n in zip(setup['slots'], setup['num_requests']))}; "
             f"cache {setup['capacity']} slots per row; rounds at the smallest batch size holding the busy rows "
             f"(buckets {setup['buckets']!r}) in every mode; CPU kernel {'on' if setup['cpu_kernel'] else 'off'}. "
             f"Loads are fractions of target-only's saturated rate at that slot count; Poisson and bursty (gamma gaps, "
             f"shape {setup['burstiness']:g}) arrivals, the same times for every mode. Throughput = generated tokens / "
             f"(last finish - first arrival); TTFT = arrival -> first token; ITL = a request's mean time between its "
             f"tokens after the first (p50/p90 over requests); tokens/pass = generated tokens / row rounds; 'same' = "
             f"requests whose tokens equal target-only's (greedy).", "",
             "## Aims", "", toolkit.table(["aim", "measured", "met"], aims(records)), ""]
    head = ["load", "mode", "tok/s", "vs target-only", "TTFT p50 s", "TTFT p90 s", "ITL p50 ms", "ITL p90 ms",
            "tokens/pass", "rounds per gamma", "rounds per batch size", "same"]
    base = {(r["slots"], r["arrivals"], r["load"]): r for r in loads if r["mode"] == "target-only"}
    for slots in setup["slots"]:
        c = cap.get(slots)
        lines += [f"## {slots} slots", ""]
        if c:
            lines += [f"Target-only saturates at {c['requests_per_s']:.3f} requests/s ({c['tokens_per_s']:.1f} tokens/s).", ""]
        rows = []
        for r in (x for x in loads if x["slots"] == slots):
            b = base.get((slots, r["arrivals"], r["load"]))
            gammas = cal[(slots, r["mode"])]["gammas"] if (slots, r["mode"]) in cal else []
            sizes = r.get("rounds_per_size", {})
            rows.append([load_label(r["arrivals"], r["load"]), r["mode"], toolkit.fmt(r["throughput_tok_s"], 1),
                         toolkit.fmt(r["throughput_tok_s"] / b["throughput_tok_s"], 2) + "x" if b else "–",
                         toolkit.fmt(r["ttft_s_p50"], 2), toolkit.fmt(r["ttft_s_p90"], 2),
                         _ms(r["inter_token_s_p50"]), _ms(r["inter_token_s_p90"]),
                         toolkit.fmt(r["mean_accepted_tokens_per_pass"], 2),
                         _share(r["rounds_per_gamma"], gammas) if gammas else "–",
                         _share(list(sizes.values()), list(sizes)), f"{r['same_tokens_as_target_only']}/{r['requests']}"])
        rows.sort(key=lambda x: (x[0] != "all at once", x[0]))
        lines += [toolkit.table(head, rows), ""]
    if live:
        offline = {(r["slots"], r["mode"], r["arrivals"], r["load"]): r for r in loads}
        lines += ["## Live scheduler (real clock) against the offline scheduler, same workload", "",
                  "Transport 'engine': requests submitted to the engine thread directly; 'http': streamed "
                  "`/v1/completions` calls to `specjax serve`'s application on 127.0.0.1 from an asyncio client in "
                  "the same process (times taken as text chunks arrive; 'same' compares the text with target-only's "
                  "tokens decoded as the server decodes them).", ""]
        rows = []
        for r in live:
            o = offline.get((r["slots"], r["mode"], r["arrivals"], r["load"]))
            rows.append([str(r["slots"]), load_label(r["arrivals"], r["load"]), r["mode"], r.get("transport", "engine"),
                         toolkit.fmt(r["throughput_tok_s"], 1),
                         toolkit.fmt(o["throughput_tok_s"], 1) if o else "–",
                         toolkit.fmt(r["throughput_tok_s"] / o["throughput_tok_s"], 3) + "x" if o else "–",
                         _ms(r["inter_token_s_p50"]), _ms(o["inter_token_s_p50"]) if o else "–",
                         toolkit.fmt(r["ttft_s_p50"], 2), str(r["lost"]), f"{r['same_tokens_as_target_only']}/{r['requests']}"])
        lines += [toolkit.table(["slots", "load", "mode", "transport", "live tok/s", "offline tok/s", "live / offline",
                                 "live ITL p50 ms", "offline ITL p50 ms", "live TTFT p50 s", "lost", "same"], rows), ""]
    if cal:
        lines += ["## Calibrated round times (ms per round, per batch size and gamma)", ""]
        rows = []
        for (slots, mode), r in cal.items():
            for size, ts in r["round_time_s"].items():
                rows.append([str(slots), mode, size, ", ".join(f"{1e3 * t:.1f}" for t in ts)])
        gammas = ", ".join(map(str, next(iter(cal.values()))["gammas"]))
        lines += ["A drafter with several draft sources (the hybrid: its model, then prompt lookup) has one "
                  "row of times per source, one after the other.", "",
                  toolkit.table(["slots", "mode", "batch size", f"gammas {gammas} (per draft source)"], rows), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(toolkit.read_jsonl(sys.argv[1])), end="")
