"""Theory vs measurement and the gamma sweep, from the run's JSONL alone:

    python -m experiments.theory.plot [experiments/theory/results/results.jsonl]

Writes beside the JSONL, per temperature t:

* ``theory_T{t}.png``: left, accepted tokens per target pass against gamma: Leviathan et al.'s
  (2023, eq. 1) i.i.d. expectation (1 - alpha^(gamma+1)) / (1 - alpha) at each drafter's
  measured alpha (its gamma = 1 acceptance; grey: alpha = 0.2 .. 0.8) with the measured points;
  right, speedup over target-only: Leviathan's wall-time improvement
  (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) with the measured c (one draft step over
  one target step; it assumes scoring gamma + 1 tokens costs one step), the same expectation
  priced with the measured (gamma + 1)-token pass (`specjax.analysis.RoundCost`), and the
  measured speedup; adaptive drafting as a star at its mean gamma per round.
* ``gamma_sweep_T{t}.png``: per drafter, speedup and accepted tokens per pass against gamma for
  each Spec-Bench category (one question each), adaptive drafting at the right.
* ``theory.md``: the numbers of both, with the gap between measured and predicted speedup
  split into its factors (acceptance, the in-loop one-token step vs the probe, round cost).
"""

from __future__ import annotations

import pathlib
import sys

from experiments.lib import toolkit
from specjax import analysis


def _gamma(setting: str) -> int | None:
    """A chain's gamma ("chain:3", "chain:3@block"), None otherwise."""
    return int(setting.split(":")[1].split("@")[0]) if setting.startswith("chain:") else None


def rows(records: list[dict]) -> list[dict]:
    """One row per (temperature, drafter, setting): measured and predicted figures."""
    costs = {r["n"]: r["median_s"] for r in records if r["kind"] == "node_cost"}
    dcost = {(r["drafter"], r["gamma"]): r["median_s"] for r in records if r["kind"] == "draft_cost"}
    gens = [r for r in records if r["kind"] == "generation"]
    out = []
    for temp in sorted({r["temperature"] for r in gens}):
        base = next(r for r in gens if r["temperature"] == temp and r["drafter"] == "none")
        step_loop = base["seconds"] / max(base["target_passes"], 1)
        for d in dict.fromkeys(r["drafter"] for r in gens if r["drafter"] != "none"):
            mine = [r for r in gens if r["temperature"] == temp and r["drafter"] == d]
            # alpha: first-position acceptance of the shortest chain (gamma 1 when it ran)
            chains = sorted((r for r in mine if _gamma(r["setting"]) is not None), key=lambda r: _gamma(r["setting"]))
            if not chains:
                continue
            g1 = chains[0]
            alpha = min(g1["accepted_at"][0] / max(g1["tested_at"][0], 1), 1 - 1e-9)
            for r in mine:
                g = _gamma(r["setting"])
                if g is None and r["setting"] != "adaptive":
                    continue                # trees: not priced by the chain formulas
                row = {"temperature": temp, "drafter": d, "setting": r["setting"], "gamma": g, "alpha": alpha,
                       "measured_tokens_per_pass": r["accepted_tokens_per_pass"],
                       "measured_speedup": r["tokens_per_s"] / base["tokens_per_s"],
                       "acceptance_per_position": [a / t if t else None for a, t in zip(r["accepted_at"], r["tested_at"])],
                       "round_s": r["seconds"] / max(r["target_passes"], 1), "step_loop_s": step_loop,
                       "step_probe_s": costs.get(1)}
                if g is None:       # adaptive: its mean gamma per round
                    counts, gammas = r.get("rounds_per_gamma") or [], r.get("gammas") or []
                    row["mean_gamma"] = (sum(n * x for n, x in zip(counts, gammas)) / max(sum(counts), 1)
                                         if counts else None)
                    row["rounds_per_gamma"] = dict(zip(map(str, gammas), counts))
                elif (d, g) in dcost and 1 in costs and g + 1 in costs:
                    draft_s = dcost[(d, g)]
                    c = draft_s / g / costs[1]
                    e = analysis.expected_tokens_per_round(alpha, g)
                    rc = analysis.RoundCost(draft_s=draft_s / g, verify_s={1: costs[1], g + 1: costs[g + 1]})
                    pred = rc.predicted_speedup(alpha, g, costs[1])
                    row.update(c=c, theory_tokens_per_pass=e,
                               leviathan_speedup=analysis.walltime_improvement(alpha, g, c),
                               cost_model_speedup=pred, pass_cost_rel=costs[g + 1] / costs[1],
                               predicted_round_s=draft_s + costs[g + 1])
                    # measured / predicted = acceptance x baseline step x round cost factors
                    row["factor_acceptance"] = r["accepted_tokens_per_pass"] / e
                    row["factor_step"] = step_loop / costs[1]
                    row["factor_round"] = row["predicted_round_s"] / row["round_s"]
                out.append(row)
    return out


def categories(records: list[dict]) -> list[dict]:
    """Per (temperature, drafter, setting, category): speedup and accepted tokens per pass."""
    gens = [r for r in records if r["kind"] == "generation" and r.get("per_prompt")]
    out = []
    for temp in sorted({r["temperature"] for r in gens}):
        base = next(r for r in gens if r["temperature"] == temp and r["drafter"] == "none")
        base_rate = {}
        for p in base["per_prompt"]:
            base_rate.setdefault(p["category"], [0, 0.0])
            base_rate[p["category"]][0] += p["new_tokens"]
            base_rate[p["category"]][1] += p["seconds"]
        for r in gens:
            if r["temperature"] != temp or r["drafter"] == "none":
                continue
            agg = {}
            for p in r["per_prompt"]:
                a = agg.setdefault(p["category"], [0, 0.0, 0])
                a[0] += p["new_tokens"]
                a[1] += p["seconds"]
                a[2] += p["target_passes"]
            for cat, (n, s, passes) in agg.items():
                bn, bs = base_rate[cat]
                out.append({"temperature": temp, "drafter": r["drafter"], "setting": r["setting"], "category": cat,
                            "speedup": (n / s) / (bn / bs), "tokens_per_pass": n / max(passes, 1)})
    return out


def markdown(records: list[dict]) -> str:
    gens = [r for r in records if r["kind"] == "generation"]
    prov = gens[0]["provenance"]
    costs = {r["n"]: r["median_s"] for r in records if r["kind"] == "node_cost"}
    lines = ["# Theory vs measurement, and the gamma sweep", "", *toolkit.provenance_lines(prov), "",
             "Target pass of N tokens (ms): " + ", ".join(f"N={n}: {1e3 * s:.1f}" for n, s in sorted(costs.items())),
             "",
             "alpha: the drafter's first-position acceptance at its shortest chain, gamma = 1 here (Leviathan et al.'s i.i.d. alpha); c: one draft step over "
             "one target step (measured proposal of gamma tokens / gamma / the 1-token pass); 'Leviathan': their "
             "wall-time improvement, which assumes a (gamma+1)-token pass costs one step; 'cost model': the same "
             "expected tokens priced with the measured (gamma+1)-token pass. The ratio measured / cost model is "
             "the product of three factors: acceptance (measured tokens per pass / i.i.d. expectation: below 1 "
             "where acceptance falls along the draft, as it does for real text), step (the in-loop target-only "
             "step / the isolated 1-token probe: loop overhead the probe does not see) and round (predicted / "
             "measured round time: overhead of drafting and bookkeeping inside the loop).", ""]
    head = ["T", "drafter", "setting", "alpha", "c", "pass (g+1) / 1", "tokens/pass theory", "measured",
            "accept. per position", "Leviathan", "cost model", "measured speedup", "factor acceptance",
            "factor step", "factor round"]
    body = []
    for r in rows(records):
        f = lambda k, d=2: toolkit.fmt(r.get(k), d)       # noqa: E731
        acc = ", ".join("–" if a is None else f"{a:.2f}" for a in r["acceptance_per_position"])
        setting = r["setting"] if r["gamma"] is not None else (
            f"adaptive (mean gamma {r['mean_gamma']:.2f})" if r.get("mean_gamma") is not None else "adaptive")
        body.append([f"{r['temperature']:g}", toolkit.drafter_label(r["drafter"]), setting, f("alpha"), f("c", 3), f("pass_cost_rel"),
                     f("theory_tokens_per_pass"), f("measured_tokens_per_pass"), acc, f("leviathan_speedup"),
                     f("cost_model_speedup"), f("measured_speedup"), f("factor_acceptance"), f("factor_step"),
                     f("factor_round")])
    lines += [toolkit.table(head, body), "", "## Gamma sweep per Spec-Bench category (speedup x target-only / "
              "accepted tokens per pass)", ""]
    cats = categories(records)
    for temp in sorted({r["temperature"] for r in cats}):
        for d in dict.fromkeys(r["drafter"] for r in cats):
            mine = [r for r in cats if r["temperature"] == temp and r["drafter"] == d]
            settings = list(dict.fromkeys(r["setting"] for r in mine))
            table = []
            for cat in sorted({r["category"] for r in mine}):
                cells = {r["setting"]: r for r in mine if r["category"] == cat}
                best = max((s for s in settings if s.startswith("chain:")), key=lambda s: cells[s]["speedup"])
                table.append([cat, *[f"{cells[s]['speedup']:.2f}x / {cells[s]['tokens_per_pass']:.2f}" for s in settings],
                              best])
            lines += [f"### T = {temp:g}, {toolkit.drafter_label(d)}", "", toolkit.table(["category", *settings, "best chain"], table), ""]
    return "\n".join(lines)


def _title(prov, what, temp):
    return f"{what}, T = {temp:g}\n{toolkit.model_label(prov.get('model'))} target, {toolkit.run_caption(prov)}"


def plot(path) -> list[pathlib.Path]:
    plt = toolkit.pyplot()

    path = pathlib.Path(path)
    records = toolkit.read_jsonl(path)
    prov = next(r for r in records if r["kind"] == "generation")["provenance"]
    rs = rows(records)
    written = []
    for temp in sorted({r["temperature"] for r in rs}):
        mine = [r for r in rs if r["temperature"] == temp]
        drafters = list(dict.fromkeys(r["drafter"] for r in mine))
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, 5.5))
        gmax = max((r["gamma"] for r in mine if r["gamma"] is not None), default=1)
        grid = list(range(1, gmax + 1))
        for a in (0.2, 0.4, 0.6, 0.8):
            ax1.plot(grid, [analysis.expected_tokens_per_round(a, g) for g in grid], color="0.8", lw=1)
            ax1.annotate(f"alpha={a:g}", (grid[-1], analysis.expected_tokens_per_round(a, grid[-1])), fontsize=6,
                         color="0.5")
        for i, d in enumerate(drafters):
            color = f"C{i}"
            chains = sorted((r for r in mine if r["drafter"] == d and r["gamma"] is not None), key=lambda r: r["gamma"])
            adaptive = [r for r in mine if r["drafter"] == d and r["gamma"] is None]
            if not chains:
                continue
            alpha = chains[0]["alpha"]
            gs = [r["gamma"] for r in chains]
            ax1.plot(grid, [analysis.expected_tokens_per_round(alpha, g) for g in grid], "-", color=color,
                     label=f"{toolkit.drafter_label(d)}: theory at alpha = {alpha:.2f}")
            ax1.plot(gs, [r["measured_tokens_per_pass"] for r in chains], "o", color=color, label=f"{toolkit.drafter_label(d)}: measured")
            priced = [r for r in chains if "cost_model_speedup" in r]
            if priced:
                ax2.plot([r["gamma"] for r in priced], [r["leviathan_speedup"] for r in priced], ":", color=color,
                         label=f"{toolkit.drafter_label(d)}: Leviathan (pass = 1 step), c = {priced[0]['c']:.3f}")
                ax2.plot([r["gamma"] for r in priced], [r["cost_model_speedup"] for r in priced], "-", color=color,
                         label=f"{toolkit.drafter_label(d)}: measured pass costs")
            ax2.plot(gs, [r["measured_speedup"] for r in chains], "o", color=color, label=f"{toolkit.drafter_label(d)}: measured")
            for r in adaptive:
                if r.get("mean_gamma") is not None:
                    ax1.plot([r["mean_gamma"]], [r["measured_tokens_per_pass"]], "*", ms=12, color=color)
                    ax2.plot([r["mean_gamma"]], [r["measured_speedup"]], "*", ms=12, color=color,
                             label=f"{toolkit.drafter_label(d)}: adaptive (at its mean gamma)")
        ax2.axhline(1.0, color="gray", lw=0.8)
        for ax, yl, t in ((ax1, "accepted tokens per target pass", "Tokens per pass: i.i.d. theory vs measured"),
                          (ax2, "speedup (x target-only tokens/s)", "Speedup: predicted vs measured")):
            ax.set_xlabel("gamma (draft tokens per round; star: adaptive at its mean gamma)")
            ax.set_ylabel(yl)
            ax.set_title(_title(prov, t, temp), fontsize=9)
            ax.set_xticks(grid)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        out = path.with_name(f"theory_T{temp:g}.png")
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)

        cats = [r for r in categories(records) if r["temperature"] == temp]
        fig, axes = plt.subplots(2, len(drafters), figsize=(4 * len(drafters), 7), squeeze=False)
        names = sorted({r["category"] for r in cats})
        cmap = plt.get_cmap("tab20")
        for j, d in enumerate(drafters):
            mine_c = [r for r in cats if r["drafter"] == d]
            settings = list(dict.fromkeys(r["setting"] for r in mine_c))
            xs = {s: i for i, s in enumerate(settings)}
            for k, cat in enumerate(names):
                pts = sorted((r for r in mine_c if r["category"] == cat), key=lambda r: xs[r["setting"]])
                for row, key in ((0, "speedup"), (1, "tokens_per_pass")):
                    axes[row][j].plot([xs[r["setting"]] for r in pts], [r[key] for r in pts], "o-", ms=3, lw=1,
                                      color=cmap(k % 20), label=cat if j == 0 and row == 0 else None)
            for row, yl in ((0, "speedup (x target-only)"), (1, "accepted tokens per pass")):
                ax = axes[row][j]
                ax.set_xticks(range(len(settings)), [s.replace("chain:", "g") for s in settings])
                ax.set_xlabel("gamma (g1..), adaptive")
                ax.set_ylabel(yl)
                ax.grid(alpha=0.3)
                if row == 0:
                    ax.axhline(1.0, color="gray", lw=0.8)
                    ax.set_title(toolkit.drafter_label(d), fontsize=9)
        fig.legend(fontsize=6, loc="lower center", ncol=7)
        fig.suptitle(_title(prov, "Gamma sweep per Spec-Bench category", temp), fontsize=9)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        out = path.with_name(f"gamma_sweep_T{temp:g}.png")
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    md = path.with_name("theory.md")
    md.write_text(markdown(records) + "\n")
    written.append(md)
    return written


if __name__ == "__main__":
    for p in plot(sys.argv[1] if len(sys.argv) > 1 else "experiments/theory/results/results.jsonl"):
        print(p)
