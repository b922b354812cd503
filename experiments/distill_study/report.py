"""The distillation study's Markdown tables, from its JSONL alone (`render`)."""

from __future__ import annotations

import statistics

from experiments.lib import toolkit

DIV_LABELS = {"fkl": "FKL", "rkl": "RKL", "jsd": "JSD (beta 0.5)", "tvd": "TVD"}


def cells(records, key: str) -> dict[tuple[str, str], list[float]]:
    """(divergence, source) -> the runs' values of `key`, in seed order."""
    out: dict[tuple[str, str], list[float]] = {}
    for r in sorted((r for r in records if r["kind"] == "run"), key=lambda r: r["seed"]):
        out.setdefault((r["divergence"], r["source"]), []).append(r[key])
    return out


def _grid(records, key: str, digits: int = 3, delta_from: float | None = None) -> str:
    setup = next(r for r in records if r["kind"] == "setup")
    divs = [d for d in setup["divergences"]]
    sources = list(dict.fromkeys(r["source"] for r in records if r["kind"] == "run"))
    vals = cells(records, key)
    rows = []
    for d in divs:
        row = [DIV_LABELS.get(d, d)]
        for s in sources:
            v = vals.get((d, s), [])
            if not v:
                row.append("–")
                continue
            m = statistics.fmean(v)
            txt = f"**{m:.{digits}f}** ({', '.join(f'{x:.{digits}f}' for x in v)})"
            if delta_from is not None:
                txt += f", {m - delta_from:+.{digits}f}"
            row.append(txt)
        rows.append(row)
    return toolkit.table(["divergence"] + sources, rows)


def render(records) -> str:
    setup = next(r for r in records if r["kind"] == "setup")
    start = next(r for r in records if r["kind"] == "start")
    runs = [r for r in records if r["kind"] == "run"]
    prov = setup["provenance"]
    t = setup["training"]
    d = t["data"]
    seeds = setup["seeds"]
    a0 = start["alpha"]
    alpha = cells(records, "alpha_after")
    best = max(alpha, key=lambda k: statistics.fmean(alpha[k]))
    spread = max((max(v) - min(v) for v in alpha.values() if len(v) > 1), default=float("nan"))
    sources = list(dict.fromkeys(r["source"] for r in runs))
    first = runs[0]
    # Medians over each source's runs that did not make the shared data sets (the first run did).
    per_source = {s: [r for r in runs if r["source"] == s and r is not first] or [first] for s in sources}
    med = lambda xs: statistics.median(list(xs))      # noqa: E731
    f = toolkit.fmt
    lines = [
        "# Distillation study: divergence x data source at a fixed budget (DistillSpec)", "",
        *toolkit.provenance_lines(prov),
        f"- study wall time: {start['study_wall_s'] / 60:.1f} min for {len(runs)} runs "
        f"({sum(r['reused'] for r in runs)} read back from earlier invocations)", "",
        f"Draft: the target's layers {t['draft']['layers']} and a reduced head over {t['draft']['head_vocab']} tokens "
        f"(the target's rows), the same at the start of every run. Budget: {setup['budget_tokens']} loss tokens per "
        f"run ({t['data']['tokens_per_batch']} positions a step), learning rate {t['optim']['learning_rate']:g} "
        f"(warm-up {t['optim']['warmup_steps']} steps, cosine). Data: Spec-Bench train prompts of at most "
        f"{d['max_prompt_tokens']} tokens, the first {d['per_category']} of each category; *target*: the target's "
        f"greedy continuations ({d['max_new_tokens']} new tokens); *on-policy*: the current draft's temperature-"
        f"{d['temperature']:g} continuations of {d['draft_prompts']} of those prompts ({d['draft_max_new_tokens']} "
        f"new tokens), redrawn every {d['draft_refresh_every']} steps; *mixed*: each step draws its batch from either "
        f"with probability 1/2. Seeds {seeds}: the batch order, the mixture's draws and the on-policy samples.", "",
        f"Held-out evaluation ({start['eval_tokens']} positions: the target's greedy continuations of held-out "
        f"Spec-Bench prompts of at most {t['eval']['max_prompt_tokens'] or 'any'} tokens, {t['eval']['per_category']} "
        f"per category, never trained on), teacher-forced: alpha = E[sum_x min(p, q)] at temperature 1; greedy "
        f"agreement = P(argmax q = argmax p).", "",
        f"Start: alpha **{a0:.3f}**, greedy agreement {start['agreement']:.3f}.", "",
        "## Held-out alpha after distillation", "",
        "Mean over seeds in bold, each seed in parentheses, then the change from the start.", "",
        _grid(records, "alpha_after", delta_from=a0), "",
        "## Greedy agreement after distillation", "",
        _grid(records, "agreement_after", delta_from=start["agreement"]), "",
        "## Greedy committed tokens per target pass at gamma 4 (exact simulation from the agreement)", "",
        _grid([{**r, "tp4": r["tokens_per_pass_after"].get("4")} if r["kind"] == "run" else r for r in records],
              "tp4", digits=3), "",
        "## Cost of each source (median per run)", "",
        "Wall seconds of a run: loading, training, on-policy refreshes and the final evaluation. The data "
        "sets shared by all runs are made once, in the study's first run, and not counted here: the "
        f"target's data set {f(first.get('target_data_s'), 0)} s (generation and teacher pass), the held-out "
        f"set within that run's {f(first['wall_s'], 0)} s.", "",
        toolkit.table(
            ["source", "wall s", "on-policy refreshes", "seconds in refreshes (draft generation + teacher pass)",
             "loss tokens / s (wall)"],
            [[s, f"{med(r['wall_s'] for r in rs):.0f}", f"{med(r['onpolicy_refreshes'] for r in rs):.1f}",
              f"{med(r['onpolicy_s'] for r in rs):.0f}", f"{med(r['tokens'] / r['wall_s'] for r in rs):.0f}"]
             for s, rs in per_source.items()]), "",
        f"Highest mean alpha: {DIV_LABELS.get(best[0], best[0])} on {best[1]} data "
        f"({statistics.fmean(alpha[best]):.3f}); the largest difference between the seeds of one cell: "
        f"{spread:.3f} (differences between cells smaller than that are within seed noise).", ""]
    return "\n".join(lines)
