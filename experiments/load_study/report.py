"""`results.md` of the load study, from its JSONL alone:
``python -m experiments.load_study.report RESULTS.jsonl``."""
from __future__ import annotations

import sys

from experiments.lib import toolkit


def rate_label(rate: float) -> str:
    return "all at once" if rate == 0 else f"{rate:g}/s"


def _gamma_rounds(r: dict, gammas) -> str:
    counts = r["rounds_per_gamma"]
    if len(counts) < 2:
        return "–"
    total = max(sum(counts), 1)
    return ", ".join(f"{g}: {100 * n / total:.0f}%" for g, n in zip(gammas, counts))


def render(records: list[dict]) -> str:
    setup = next((r for r in records if r["kind"] == "setup"), None)
    loads = [r for r in records if r["kind"] == "load"]
    if setup is None or not loads:
        return "no load records\n"
    cal = {r["mode"]: r for r in records if r["kind"] == "calibration"}
    prov = setup["provenance"]
    lines = ["# Load study: a slot-refilling server with and without speculation", "",
             *toolkit.provenance_lines(prov), "",
             f"{setup['requests']} held-out Spec-Bench requests (prompt tokens {min(setup['prompt_tokens'])}-"
             f"{max(setup['prompt_tokens'])}), at most {setup['max_new_tokens']} new tokens each, temperature "
             f"{setup['temperature']:g}, {setup['slots']} slots (batch rows) of {setup['capacity']} cache slots, "
             f"CPU kernel {'on' if setup['cpu_kernel'] else 'off'}. Poisson arrivals at each rate (the same times "
             f"for every mode); 'all at once' = every request at t = 0 (saturated). Throughput = generated tokens / "
             f"(last finish - first arrival); TTFT = arrival -> first token (queue + prefill + first round); ITL = "
             f"a request's mean time between tokens after its first; rounds = engine rounds (one target pass each, "
             f"all slots); tokens/pass = generated tokens / row rounds; wasted = proposed - accepted draft tokens; "
             f"'same tokens' = requests whose tokens equal target-only's (greedy; batch-shape rounding may flip a "
             f"near-tie).", ""]
    base = {r["rate"]: r for r in loads if r["mode"] == "target-only"}
    head = ["mode", "throughput tok/s", "vs target-only", "TTFT p50 s", "TTFT p90 s", "ITL p50 ms", "ITL p90 ms",
            "queue mean s", "rounds", "tokens/pass", "acceptance", "wasted", "active slots", "rounds per gamma",
            "same tokens"]
    for rate in list(dict.fromkeys(r["rate"] for r in loads)):
        lines += [f"## arrival rate {rate_label(rate)}", ""]
        rows = []
        for r in (x for x in loads if x["rate"] == rate):
            b = base.get(rate)
            rows.append([r["mode"], toolkit.fmt(r["throughput_tok_s"], 1),
                         toolkit.fmt(r["throughput_tok_s"] / b["throughput_tok_s"], 2) + "x" if b else "–",
                         toolkit.fmt(r["ttft_s_p50"], 2), toolkit.fmt(r["ttft_s_p90"], 2),
                         toolkit.fmt(1e3 * r["inter_token_s_p50"], 1) if r["inter_token_s_p50"] is not None else "–",
                         toolkit.fmt(1e3 * r["inter_token_s_p90"], 1) if r["inter_token_s_p90"] is not None else "–",
                         toolkit.fmt(r["queue_delay_s_mean"], 2), str(r["engine_rounds"]),
                         toolkit.fmt(r["mean_accepted_tokens_per_pass"], 2), toolkit.fmt(r["acceptance_rate"], 2),
                         str(r["wasted"]), toolkit.fmt(r["mean_active_slots"], 2),
                         _gamma_rounds(r, cal[r["mode"]]["gammas"]) if r["mode"] in cal else "–",
                         "–" if r["same_tokens_as_target_only"] is None else
                         f"{r['same_tokens_as_target_only']}/{r['requests']}"])
        lines += [toolkit.table(head, rows), ""]
    if cal:
        lines += ["## Calibrated round times (batch = slots)", ""]
        lines.append(toolkit.table(["mode", "gammas", "ms per round"],
                                   [[m, ", ".join(map(str, r["gammas"])), ", ".join(f"{1e3 * t:.1f}" for t in r["round_time_s"])]
                                    for m, r in cal.items()]))
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(toolkit.read_jsonl(sys.argv[1])), end="")
