"""Table, fit and plot of the heads' learning curve, from its JSONL alone.

    python -m experiments.learning_curve.report [experiments/heads/results/learning_curve.jsonl]

Writes beside the JSONL: ``learning_curve.md`` (one row per point: data tokens, training tokens,
held-out greedy agreement at steps 1..3, alpha at T = 1, simulated chain tokens per pass at the
best gamma; then per kind the least-squares fit agreement_1 = a + b log2(data tokens), the
slope's standard error from the residuals, and the data it puts at agreement 0.6, also at the
slope one standard error either side) and ``learning_curve.png`` (agreement at steps 1..3 and chain
tokens per pass against data tokens, log axis).

Beside the curve, for scale, the EAGLE heads with input norms that `experiments.heads.train`
trained on the target's own Spec-Bench training-split continuations (its summaries
``train-*.json`` in the JSONL's folder, the shipped head's recipe): the same evaluation at other
data sizes and several training budgets, so that the effect of training tokens at fixed data can
be read beside the curve's one-pass points.
"""

from __future__ import annotations

import math
import pathlib
import sys

import numpy as np

from experiments.lib import head_runs, toolkit

DEFAULT = "experiments/heads/results/learning_curve.jsonl"
AIM = 0.6


def _best_chain(ev: dict) -> tuple[float, int]:
    gs = [int(k.rsplit("_g", 1)[1]) for k in ev if k.startswith("greedy_tokens_per_pass_g")]
    g = max(gs, key=lambda g: ev[f"greedy_tokens_per_pass_g{g}"])
    return ev[f"greedy_tokens_per_pass_g{g}"], g


def fit(points: list[dict]) -> dict | None:
    """Least squares agreement_1 = a + b log2(data tokens) over one kind's points (None below 2
    distinct sizes) and the data tokens at which it reaches `AIM` (None when b <= 0 or beyond
    2^64 tokens)."""
    xs = np.log2([p["data_loss_tokens"] for p in points])
    ys = np.asarray([p["eval"]["greedy_agreement_step1"] for p in points])
    if len(set(xs.tolist())) < 2:
        return None
    b, a = np.polyfit(xs, ys, 1)
    out = {"a": float(a), "b_per_doubling": float(b), "tokens_for_aim": _tokens_for(xs, ys, b)}
    if len(xs) >= 3:    # the slope's standard error (residuals over n - 2), and the aim's data at b -/+ 1 SE
        res = ys - (a + b * xs)
        se = math.sqrt(float(res @ res) / (len(xs) - 2) / float(((xs - xs.mean()) ** 2).sum()))
        out["b_se"] = se
        out["tokens_for_aim_range"] = (_tokens_for(xs, ys, b + se), _tokens_for(xs, ys, b - se))
    return out


def _tokens_for(xs, ys, slope: float) -> float | None:
    """Data tokens at which the line of slope `slope` through the fit's centre (mean log2 data,
    mean agreement; the least-squares line passes through it) reaches `AIM`; None when it never does (slope <= 0) or beyond 2^64 tokens."""
    if slope <= 0:
        return None
    doublings = xs.mean() + (AIM - ys.mean()) / slope
    return 2.0 ** doublings if doublings < 64 else None


def _tokens_text(n: float | None) -> str:
    return "never" if n is None else f"{n:.1e} tokens"


def _command_lines(recs: list[dict], kinds: list[str]) -> list[str]:
    """Per curve, each distinct command its points were made by, with the data sizes it made
    (a point made under a size override is reproduced by its own command, not the curve's last)."""
    lines = []
    for k in kinds:
        made: dict[str, list[int]] = {}
        for r in recs:
            if r["label"] == k:
                made.setdefault((r.get("provenance") or {}).get("command", "?"), []).append(r["data_loss_tokens"])
        lines += [f"- {k} ({', '.join(f'{n:,}' for n in sizes)}): `{cmd}`" for cmd, sizes in made.items()]
    return lines


def _error_note(recs: list[dict]) -> str:
    """How far the held-out agreement at k = 1 may move by chance: its binomial standard error
    sqrt(a (1 - a) / n) over the n evaluated tokens, the largest among the points."""
    errs = []
    for r in recs:
        a, n = (r["eval"] or {}).get("greedy_agreement_step1"), (r["eval"] or {}).get("eval_tokens")
        if a is not None and n:
            errs.append((math.sqrt(a * (1 - a) / n), n))
    if not errs:
        return "Evaluation: no evaluated points."
    se, n = max(errs)
    return (f"Evaluation: the held-out Spec-Bench continuations, {n:,} tokens; the standard error of agreement "
            f"k=1 is at most {se:.3f} (binomial, tokens taken as independent; tokens of one continuation are "
            "correlated, so the true spread is somewhat larger): differences of 2 x that or less are noise.")


def reference_runs(folder: pathlib.Path) -> list[dict]:
    """The EAGLE runs with input norms among `folder`'s training summaries that trained on the
    target's Spec-Bench training-split continuations only (no streamed shards), with their data
    tokens (`head_runs.data_tokens`) and last held-out evaluation, by (data, training tokens)."""
    paths = sorted(pathlib.Path(folder).glob("train-*.json"))
    runs = {q.stem.removeprefix("train-"): head_runs.read_summary(q) for q in paths}
    sizes = head_runs.data_tokens(runs)
    out = []
    for name, run in runs.items():
        s, cfg = run["summary"], run["provenance"].get("config", {})
        d, shards = s.get("draft") or {}, (cfg.get("data") or {}).get("shards") or {}
        ev = s.get("eval") or {}
        if d.get("kind") != "eagle" or not d.get("input_norm") or shards.get("weight", 0) > 0:
            continue
        if "greedy_agreement_step1" not in ev or not any(k.startswith("greedy_tokens_per_pass_g") for k in ev) \
                or "tokens" not in s:
            continue        # no held-out evaluation (or an older summary without its chain): nothing to set beside
        out.append({"name": name, "data_loss_tokens": sizes[name][0], "train_tokens": s["tokens"], "eval": s["eval"],
                    "feature_noise": (cfg.get("head") or {}).get("feature_noise", 0.0)})
    return sorted(out, key=lambda r: (r["data_loss_tokens"] or 0, r["train_tokens"]))


def _reference_lines(refs: list[dict]) -> list[str]:
    if not refs:
        return []
    rows = []
    for r in refs:
        ev = r["eval"]
        chain, g = _best_chain(ev)
        rows.append([r["name"] + (f" (feature noise {r['feature_noise']})" if r["feature_noise"] else ""),
                     "?" if r["data_loss_tokens"] is None else f"{r['data_loss_tokens']:,}", f"{r['train_tokens']:,}",
                     *(toolkit.fmt(ev.get(f"greedy_agreement_step{k}"), 3) for k in (1, 2, 3)),
                     toolkit.fmt(ev.get("alpha_t1"), 3), f"{toolkit.fmt(chain)} (γ = {g})"])
    return ["## For scale: EAGLE on the Spec-Bench training split", "",
            "The same evaluation of the EAGLE heads with input norms trained by `experiments.heads.train` on the "
            "target's continuations of the Spec-Bench training split alone (the shipped head's data; "
            "`TRAINING.md` has their commands): the same data at several training budgets.", "",
            toolkit.table(["run", "data tokens", "training tokens", "agreement k=1", "k=2", "k=3", "alpha (T=1)",
                           "chain tokens / pass"], rows), ""]


def write(path=DEFAULT) -> pathlib.Path:
    path = pathlib.Path(path)
    recs = [r for r in toolkit.read_jsonl(path) if r.get("kind") == "point"]
    if not recs:
        raise ValueError(f"{path}: no learning-curve points")
    for r in recs:     # a point's curve: its kind, and its series when it has one
        r["label"] = r["kind_of_head"] + (f" ({r['series']})" if r.get("series") else "")
    recs.sort(key=lambda r: (r["label"], r["data_loss_tokens"]))
    rows = []
    for r in recs:
        ev = r["eval"] or {}
        chain, g = _best_chain(ev) if ev else (float("nan"), 0)
        prov = r.get("provenance") or {}
        rows.append([r["label"], f"{r['data_loss_tokens']:,}", f"{r['train_tokens']:,}",
                     *(toolkit.fmt(ev.get(f"greedy_agreement_step{k}"), 3) for k in (1, 2, 3)),
                     toolkit.fmt(ev.get("alpha_t1"), 3), f"{toolkit.fmt(chain)} (γ = {g})",
                     f"{r['wall_s'] / 60:.0f} min ({r['train_tokens_per_s']:.0f}/s)",
                     (prov.get("machine") or {}).get("cpu_model", "?"),
                     f"`{(prov.get('git_commit') or '?')[:8]}`{'+' if prov.get('git_dirty') else ''}"])
    kinds = sorted({r["label"] for r in recs})
    fits = {k: fit([r for r in recs if r["label"] == k and r["eval"]]) for k in kinds}
    lines = ["# Learning curve of the feature heads", "",
             f"`python -m experiments.learning_curve.run --config=experiments/learning_curve/config.py`; "
             f"{len(recs)} points, each with the machine (2 CPUs) and commit it ran on.", "",
             toolkit.table(["head", "data tokens", "training tokens", "agreement k=1", "k=2", "k=3", "alpha (T=1)",
                            "chain tokens / pass", "training time (tokens/s)", "machine", "commit"], rows), "",
             "Training time: the point's run alone (a resumed run: its last part), on a machine shared with "
             "other jobs; commit: the code it ran (+: with uncommitted changes).", "",
             _error_note(recs), "",
             "Commands:", "",
             *_command_lines(recs, kinds),
             "",
             f"Fit per kind, agreement at k = 1 = a + b log2(data tokens); data for {AIM}:", ""]
    for k, f in fits.items():
        if f is None:
            lines.append(f"- {k}: fewer than two data sizes")
        else:
            need = ("not reached (b <= 0, or beyond 2^64 tokens)" if f["tokens_for_aim"] is None
                    else f"{f['tokens_for_aim']:,.0f} tokens")
            se = f" ± {f['b_se']:.4f}" if "b_se" in f else ""
            span = ""
            if "tokens_for_aim_range" in f:
                lo, hi = f["tokens_for_aim_range"]
                span = (f" (slope ± 1 SE: {_tokens_text(lo)} to {_tokens_text(hi)})")
            lines.append(f"- {k}: a = {f['a']:.3f}, b = {f['b_per_doubling']:+.4f}{se} per doubling; {AIM}: {need}{span}")
    refs = reference_runs(path.parent)
    lines += ["", *_reference_lines(refs)]
    md = path.with_name("learning_curve.md")
    md.write_text("\n".join(lines) + "\n")
    plt = toolkit.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 5))
    steps = ((1, "-o"), (2, "--s"), (3, ":^"))
    for i, k in enumerate(kinds):       # one colour per curve on both panels, one line style per step k
        pts = [r for r in recs if r["label"] == k and r["eval"]]
        x = [p["data_loss_tokens"] for p in pts]
        for step, style in steps:
            ax1.plot(x, [p["eval"].get(f"greedy_agreement_step{step}", math.nan) for p in pts], style,
                     color=f"C{i}", label=k if step == 1 else None)
        ax2.plot(x, [_best_chain(p["eval"])[0] for p in pts], "-o", color=f"C{i}", label=k)
    for step, style in steps:
        ax1.plot([], [], style, color="0.5", label=f"k = {step}")
    refs = [r for r in refs if r["data_loss_tokens"]]
    if refs:    # the Spec-Bench-split heads, each labelled with its training tokens
        x = [r["data_loss_tokens"] for r in refs]
        ax1.plot(x, [r["eval"]["greedy_agreement_step1"] for r in refs], "kx", label="Spec-Bench split, k=1")
        ax2.plot(x, [_best_chain(r["eval"])[0] for r in refs], "kx", label="Spec-Bench split")
        for r in refs:
            for ax, y in ((ax1, r["eval"]["greedy_agreement_step1"]), (ax2, _best_chain(r["eval"])[0])):
                ax.annotate(f"{r['train_tokens'] / 1e6:.1f}M", (r["data_loss_tokens"], y), fontsize=6,
                            textcoords="offset points", xytext=(4, -3))
    for ax, ylabel in ((ax1, "held-out greedy agreement"), (ax2, "chain tokens / target pass (best gamma)")):
        ax.set_xscale("log")
        ax.set_xlabel("data (loss tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3)
    fig.suptitle(f"Feature heads on SmolLM2-135M-Instruct data ({len(recs)} points; machines in learning_curve.md)",
                 fontsize=9)
    toolkit.save_figure(fig, path.with_name("learning_curve.png"))
    print(f"wrote {md} and {path.with_name('learning_curve.png')}")
    return md


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else DEFAULT)
