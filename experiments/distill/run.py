"""Distill drafts for SmolLM2-135M-Instruct and evaluate them on held-out Spec-Bench prompts.

    python -m experiments.distill.run --stage all          # compare + recipe + evaluate
    python -m experiments.distill.run --stage compare      # one 100k-token run per divergence
    python -m experiments.distill.run --stage recipe       # configs/distill.py (1M tokens) -> shipped draft
    python -m experiments.distill.run --stage evaluate     # the table in experiments/distill/results/

Every stage resumes: training runs continue from their checkpoints in ``--runs`` (so a long
run can span several sessions), finished runs are skipped, and data sets are cached.

Evaluation (held-out split only, never trained on):
- teacher-forced on the target's greedy continuations of 4 held-out prompts per category:
  acceptance rate alpha = E[sum_x min(p, q)] at temperature 1, greedy agreement, and the
  greedy mean committed tokens per target pass at gamma (exact simulation from the agreement,
  `specjax.distill.greedy_accepted_per_pass`);
- the engine, greedy, batch 1, on `--num_prompts` held-out prompts (round-robin over the
  categories): tokens/s of target-only and speculative decoding in the same run (medians of
  `--repeats`), the measured speedup, and the cost model's prediction beside it:
  tokens per pass x t(1-token target step) / (gamma x t(draft step) + t(gamma+1-token verify)),
  with the step times measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")


def _log(msg):
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def _config(name: str, **overrides):
    sys.path.insert(0, str(REPO))
    import importlib
    from specjax.distill import with_overrides
    return with_overrides(importlib.import_module(f"configs.{name}").get_config(), overrides)


def _finished(workdir: pathlib.Path, budget: int) -> bool:
    f = workdir / "final.json"
    return f.is_file() and json.loads(f.read_text()).get("tokens", 0) >= budget


def stage_compare(args):
    from specjax import distill
    for div in args.divergences:
        c = _config("distill_compare", **{"loss.divergence": div, "export_dir": str(args.drafts / f"compare-{div}")})
        wd = args.runs / f"compare-{div}"
        if _finished(wd, c.budget_tokens) and (args.drafts / f"compare-{div}" / "draft.json").is_file():
            _log(f"compare-{div}: done, skipped")
            continue
        _log(f"compare-{div}: training {c.budget_tokens} tokens in {wd}")
        distill.train(c, wd, log=_log)


def stage_recipe(args):
    from specjax import build, distill
    out = build.SHIPPED_DRAFTS["smollm2-135m-instruct"]
    c = _config("distill", export_dir=str(out))
    wd = args.runs / "recipe"
    if _finished(wd, c.budget_tokens) and (out / "draft.json").is_file():
        _log("recipe: done, skipped")
        return
    _log(f"recipe: training {c.budget_tokens} tokens in {wd}, exporting to {out}")
    distill.train(c, wd, log=_log)


# ----------------------------------------------------------------------------- evaluation

def _drafts_to_evaluate(args, target, params):
    """name -> (model, params, gamma, description)."""
    import jax
    from specjax import build, distill, models
    from specjax.models.draft_artifact import load_draft

    out = {}
    # The reference: the 4-layer early exit of the target (full head), undistilled.
    ee, ee_cfg = models.truncate_layers(params, target.config, 4)
    out["early_exit_4 (undistilled)"] = (models.Llama(ee_cfg), ee, "target layers 0-3, full head")
    # The distilled drafts' starting point: same architecture, before training.
    recipe_dir = build.SHIPPED_DRAFTS["smollm2-135m-instruct"]
    if (recipe_dir / "draft.json").is_file():
        desc = json.loads((recipe_dir / "draft.json").read_text())
        head_ids = None
        m, p = load_draft(recipe_dir, target, params)
        if desc["head_size"]:
            head_ids = np.asarray(p["head_ids"])
        c = _config("distill")
        choice = distill.DraftChoice.from_config(c.draft)
        m0, p0 = distill.build_draft(choice, target, params, key=jax.random.key(0), head_ids=head_ids)
        # Unrolled layers with fused projections, as `load_draft` gives the distilled ones (same speed path).
        m0 = dataclasses.replace(m0, config=m0.config.replace(scan_layers=False, fuse_projections=True))
        p0 = models.Llama(m0.config).prepare_params(p0)
        out["init (undistilled)"] = (m0, p0, ("start", args.runs / "recipe"))
    for div in args.divergences:
        d = args.drafts / f"compare-{div}"
        if (d / "draft.json").is_file():
            m, p = load_draft(d, target, params)
            out[f"{div} (100k)"] = (m, p, args.runs / f"compare-{div}")
    if (recipe_dir / "draft.json").is_file():
        m, p = load_draft(recipe_dir, target, params)
        info = json.loads((recipe_dir / "draft.json").read_text())["info"]
        out[f"recipe: {info.get('divergence')} ({info.get('tokens')} tokens, shipped)"] = (m, p, args.runs / "recipe")
    return out


def stage_evaluate(args):
    from specjax import build
    from specjax.distill import _data, _prepare, _train
    from specjax.drafters import ModelDrafter
    from specjax.models.tokenizer import load_tokenizer

    from experiments.bench_speed import common, sj_bench, workload

    c = _config("distill")
    target, params = build.load_target(c.target)
    tok = load_tokenizer(c.target)
    eval_plan = _data.BatchPlan(_prepare.eval_data(c, target, params, tok, _log), 0, c.data.tokens_per_batch,
                                tuple(c.data.widths))
    full_head = _train.teacher_head(target, params, None)
    drafts = _drafts_to_evaluate(args, target, params)
    gamma, gammas = args.gamma, tuple(range(1, args.max_gamma + 1))

    # The engine runs on the benchmark's target (unrolled layers, per-layer cache: the fast path).
    wl = workload.load_workload(c.target, args.num_prompts, args.out / "_work", layers="fused")
    inputs = sj_bench.prepare_inputs(wl, args.max_new_tokens, max(gammas), args.pad_multiple, seed=0)
    log = common.CompileLog()
    log.__enter__()

    class Provider:
        def __init__(self):
            self.d = {name: (ModelDrafter(m), p) for name, (m, p, _) in drafts.items()}
            self.d["none"] = (None, None)

        def get(self, kind):
            return self.d[kind]

    runner = sj_bench.Runner(wl, Provider(), log, args.max_new_tokens, args.repeats, wl.eos_ids)
    cap = max(i.capacity for i in inputs)
    ctx = min(256, cap - max(gammas) - 2)
    t_cost = sj_bench.forward_cost(wl.target, wl.params, [1] + [g + 1 for g in gammas], ctx, cap,
                                   args.cost_iters, log)
    t_k = {k: v["median_s"] for k, v in t_cost.items()}
    t1 = t_k[1]

    args.out.mkdir(parents=True, exist_ok=True)
    git = common.git_state(exclude=[args.out])
    prov = {"git": git, "machine": common.machine(), "target_sha256": wl.model_sha256,
            "prompt_ids": [i.prompt.question_id for i in inputs], "gamma": gamma, "gammas": list(gammas),
            "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
            "command": "python -m experiments.distill.run " + " ".join(sys.argv[1:])}
    writer = common.JsonlWriter(args.out / "results.jsonl", prov)
    writer.write("target_cost", t_k_s={str(k): v for k, v in t_k.items()})

    def predicted(tpp, g, d_cost):
        """Cost model: committed tokens per pass x t(1-token step) / (g draft steps + (g+1)-token verify)."""
        return tpp * t1 / (g * d_cost + t_k[g + 1])

    base = {}
    _log("target-only runs")
    for inp in inputs:
        r = runner.run(sj_bench.DecodeConfig("target only", "none", 0), 0.0, inp)
        base[inp.prompt.question_id] = r
        writer.write("run", draft="none", **{k: v for k, v in r.items() if k != "generated_ids"})
    base_tps = float(np.mean([r["tokens_per_s"] for r in base.values()]))
    nan = float("nan")
    rows = []
    for name, (m, p, desc) in drafts.items():
        tf = _recorded_eval(desc, gammas)
        if tf is None:
            _log(f"{name}: teacher-forced evaluation")
            tf = _train.evaluate(m, p, full_head, eval_plan, gammas)
        d_cost = sj_bench.forward_cost(m, p, [1], ctx, cap, args.cost_iters, log)[1]["median_s"]
        preds = {g: predicted(tf[f"greedy_tokens_per_pass_g{g}"], g, d_cost) for g in gammas}
        best = max(gammas, key=lambda g: preds[g])
        row = {"draft": name, "alpha_t1": tf["alpha_t1"], "greedy_agreement": tf["greedy_agreement"],
               "sim_tokens_per_pass": tf[f"greedy_tokens_per_pass_g{gamma}"],
               "sim_tokens_per_pass_by_gamma": {str(g): tf[f"greedy_tokens_per_pass_g{g}"] for g in gammas},
               "predicted_by_gamma": {str(g): v for g, v in preds.items()}, "best_gamma": best,
               "draft_step_over_target": d_cost / t1, "target_tokens_per_s": base_tps,
               "predicted_speedup": preds[best], "what": str(desc)}
        if name.startswith("early_exit_4"):
            # The reference for acceptance only: its speed is bench_speed's `early_exit` (shared cache).
            row.update(engine_tokens_per_pass=nan, tokens_per_s=nan, speedup_mean=nan, speedup_of_means=nan,
                       greedy_outputs_identical=None)
            rows.append(row)
            writer.write("summary", **row)
            continue
        runs, ok = [], True
        for inp in inputs:
            r = runner.run(sj_bench.DecodeConfig(name, name, best), 0.0, inp)
            ok &= r["generated_ids"] == base[inp.prompt.question_id]["generated_ids"]
            runs.append(r)
            writer.write("run", draft=name, gamma=best, **{k: v for k, v in r.items() if k != "generated_ids"})
        tps = float(np.mean([r["tokens_per_s"] for r in runs]))
        speedups = [r["tokens_per_s"] / base[r["question_id"]]["tokens_per_s"] for r in runs]
        per_pass = sum(r["committed"] for r in runs) / max(sum(r["rounds"] for r in runs), 1)
        row.update(engine_tokens_per_pass=per_pass, tokens_per_s=tps, speedup_mean=float(np.mean(speedups)),
                   speedup_of_means=tps / base_tps, predicted_engine=predicted(per_pass, best, d_cost),
                   greedy_outputs_identical=bool(ok))
        rows.append(row)
        writer.write("summary", **row)
        _log(json.dumps(row))
    writer.close()
    log.__exit__(None, None, None)
    _write_table(args.out, rows, prov)
    import shutil
    for wd in sorted(args.runs.iterdir()) if args.runs.is_dir() else []:
        if (wd / "metrics.jsonl").is_file():
            shutil.copy(wd / "metrics.jsonl", args.out / f"metrics-{wd.name}.jsonl")


def _recorded_eval(where, gammas):
    """The teacher-forced evaluation a training run already wrote (its last one, or with
    ``("start", workdir)`` its step-0 one), when it covers every gamma in `gammas`; else None."""
    start = isinstance(where, tuple)
    workdir = where[1] if start else where
    if not isinstance(workdir, pathlib.Path) or not (workdir / "metrics.jsonl").is_file():
        return None
    evals = [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "eval" and all(f"greedy_tokens_per_pass_g{g}" in r for g in gammas)]
    if start:
        evals = [r for r in evals if r["step"] == 0]
    return (evals[0] if start else evals[-1]) if evals else None


def _write_table(out: pathlib.Path, rows, prov):
    g = prov["gamma"]
    git, mach = prov["git"], prov["machine"]
    lines = [
        "# Distilled drafts for SmolLM2-135M-Instruct: held-out Spec-Bench evaluation", "",
        f"Command: `{prov['command']}`  ",
        f"Commit: `{git.get('git_commit')}`{' (working tree dirty)' if git.get('git_dirty') else ''}; "
        f"target GGUF sha256 `{prov['target_sha256']}`  ",
        f"Machine: {mach.get('cpu_model')}, {mach.get('cpus_usable')} usable cores, "
        f"{mach.get('mem_total_gib')} GiB; jax {mach.get('jax')}; batch 1, float32, greedy, "
        f"{prov['max_new_tokens']} new tokens, median of {prov['repeats']} runs.  ",
        f"Engine prompts (held-out question ids): {prov['prompt_ids']}", "",
        "alpha: E[sum min(p, q)] at temperature 1; agreement: argmax q = argmax p; both teacher-forced on the "
        f"target's greedy continuations of 4 held-out prompts per category. Tokens/pass: committed tokens per "
        f"target forward (sim: exact simulation from the agreement, at gamma = {g} and at the chosen gamma; "
        "engine: measured). The engine runs each draft at the gamma in "
        f"{prov['gammas']} with the highest predicted speedup. Predicted speedup: tokens/pass x t(target step) "
        "/ (gamma t(draft step) + t(verify gamma+1)), step times measured in this run; *pred. (engine)* uses "
        "the engine's measured tokens/pass (it tests the cost model alone).", "",
        f"| draft | alpha (T=1) | greedy agreement | tokens/pass sim, gamma {g} | chosen gamma | tokens/pass sim "
        "| tokens/pass engine | draft cost / target | tokens/s | speedup (measured) | speedup (predicted) "
        "| pred. (engine) | greedy output = target-only |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["best_gamma"]
        lines.append(f"| {r['draft']} | {r['alpha_t1']:.3f} | {r['greedy_agreement']:.3f} | "
                     f"{r['sim_tokens_per_pass']:.2f} | {b} | {r['sim_tokens_per_pass_by_gamma'][str(b)]:.2f} | "
                     f"{r['engine_tokens_per_pass']:.2f} | {r['draft_step_over_target']:.3f} | "
                     f"{r['tokens_per_s']:.1f} (target {r['target_tokens_per_s']:.1f}) | "
                     f"{r['speedup_mean']:.2f}x | {r['predicted_speedup']:.2f}x | "
                     f"{r.get('predicted_engine', float('nan')):.2f}x | {r['greedy_outputs_identical']} |")
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=("all", "compare", "recipe", "evaluate"), default="all")
    p.add_argument("--runs", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "specjax" / "distill_runs",
                   help="training workdirs (checkpoints, metrics.jsonl)")
    p.add_argument("--drafts", type=pathlib.Path, default=REPO / "experiments" / "distill" / "drafts",
                   help="where the comparison drafts are exported")
    p.add_argument("--out", type=pathlib.Path, default=REPO / "experiments" / "distill" / "results")
    p.add_argument("--divergences", type=lambda s: [x for x in s.split(",") if x], default=list(DIVERGENCES))
    p.add_argument("--num_prompts", type=int, default=13)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--gamma", type=int, default=4, help="fixed gamma of the tokens/pass comparison")
    p.add_argument("--max_gamma", type=int, default=4, help="the engine runs the best gamma in 1..max_gamma")
    p.add_argument("--pad_multiple", type=int, default=256)
    p.add_argument("--cost_iters", type=int, default=20)
    args = p.parse_args(argv)
    from specjax import build
    build.tune_xla_cpu()
    if args.stage in ("all", "compare"):
        stage_compare(args)
    if args.stage in ("all", "recipe"):
        stage_recipe(args)
    if args.stage in ("all", "evaluate"):
        stage_evaluate(args)


if __name__ == "__main__":
    main()
