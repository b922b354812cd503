"""Distill drafts for SmolLM2-135M-Instruct and evaluate them on held-out Spec-Bench prompts.

    python -m experiments.distill.run --config=experiments/distill/config.py [--config.stage=STAGE]

Stages: compare (100k tokens per divergence), recipe (configs/distill.py -> the shipped draft),
evaluate (results/results.jsonl, then report), report (results/README.md from the JSONL);
all = every stage in that order.

Every stage resumes: training runs continue from their checkpoints in ``runs`` (a long run can
span sessions), finished runs are skipped, generated data sets are cached by the trainer.

Evaluation (held-out split only, never trained on):
- teacher-forced on the target's greedy continuations of `configs/distill.py`'s held-out
  prompts (eval.per_category per category): alpha = E[sum_x min(p, q)] at temperature 1,
  greedy agreement and the greedy committed tokens per target pass at each gamma (exact
  simulation from the agreement, `specjax.distill.greedy_accepted_per_pass`); the trainer's
  last recorded evaluation is reused when it covers every gamma;
- the engine, greedy, batch 1, on `num_prompts` held-out prompts (the speed benchmark's
  workload and runner, fused layers): tokens/s of target-only and speculative decoding in the
  same run, and the cost model's prediction beside the measured speedup:
  tokens per pass x t(1-token target step) / (gamma t(draft step) + t(gamma+1-token verify)).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import time

import jax
import ml_collections
import numpy as np

from specjax import build, decoding, distill, drafters, models
from specjax.models import draft_artifact

from experiments.lib import toolkit
from experiments.lib import measure, workload
from experiments.distill import config as settings

TARGET = "smollm2-135m-instruct"


def _log(msg):
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def training_config(name: str, **overrides):
    return distill.with_overrides(toolkit.load_config(f"configs/{name}.py"), overrides)


def _finished(workdir: pathlib.Path, budget: int, draft_dir: pathlib.Path) -> bool:
    f = workdir / "final.json"
    return f.is_file() and json.loads(f.read_text()).get("tokens", 0) >= budget and (draft_dir / "draft.json").is_file()


def stage_compare(c):
    for div in c.divergences:
        out = pathlib.Path(c.drafts) / f"compare-{div}"
        tc = training_config("distill_compare", **{"loss.divergence": div, "export_dir": str(out)})
        wd = pathlib.Path(c.runs) / f"compare-{div}"
        if _finished(wd, tc.budget_tokens, out):
            _log(f"compare-{div}: done, skipped")
            continue
        _log(f"compare-{div}: training {tc.budget_tokens} tokens in {wd}")
        distill.train(tc, wd, log=_log)


def stage_recipe(c):
    out = build.SHIPPED_DRAFTS[TARGET]
    tc = training_config("distill", export_dir=str(out))
    wd = pathlib.Path(c.runs) / "recipe"
    if _finished(wd, tc.budget_tokens, out):
        _log("recipe: done, skipped")
        return
    _log(f"recipe: training {tc.budget_tokens} tokens in {wd}, exporting to {out}")
    distill.train(tc, wd, log=_log)


# ----------------------------------------------------------------------------- evaluation

def _recorded_eval(workdir, at_start, gammas):
    """The trainer's last evaluation in `workdir` (its step-0 one with `at_start`) when it covers
    every gamma; else None."""
    path = pathlib.Path(workdir) / "metrics.jsonl" if workdir else None
    if path is None or not path.is_file():
        return None
    evals = [r for r in toolkit.read_jsonl(path) if r.get("kind") == "eval"
             and all(f"greedy_tokens_per_pass_g{g}" in r for g in gammas) and (not at_start or r["step"] == 0)]
    return (evals[0] if at_start else evals[-1]) if evals else None


def _drafts(c, w):
    """name -> (model, params, where its training evaluations are: (workdir, at_start) or None)."""
    runs, recipe_dir = pathlib.Path(c.runs), build.SHIPPED_DRAFTS[TARGET]
    ee, ee_cfg = models.truncate_layers(w.params, w.target.config, 4)
    out = {"early_exit_4 (undistilled)": (models.Llama(ee_cfg), ee, None)}     # the reference
    if (recipe_dir / "draft.json").is_file():
        _, p = draft_artifact.load_draft(recipe_dir, w.target, w.params)
        head_ids = np.asarray(p["head_ids"]) if "head_ids" in p else None
        choice = distill.DraftChoice.from_config(training_config("distill").draft)
        m0, p0 = distill.build_draft(choice, w.target, models.canonical_params(w.params, w.target.config),
                                     key=jax.random.key(0), head_ids=head_ids)
        # unrolled layers with fused projections, as `load_draft` gives the distilled ones (same speed path)
        m0 = dataclasses.replace(m0, config=m0.config.replace(scan_layers=False, fuse_projections=True))
        out["init (undistilled)"] = (m0, models.Llama(m0.config).prepare_params(p0), (runs / "recipe", True))
    for div in c.divergences:
        d = pathlib.Path(c.drafts) / f"compare-{div}"
        if (d / "draft.json").is_file():
            out[f"{div} (100k)"] = (*draft_artifact.load_draft(d, w.target, w.params), (runs / f"compare-{div}", False))
    if (recipe_dir / "draft.json").is_file():
        info = json.loads((recipe_dir / "draft.json").read_text())["info"]
        out[f"recipe: {info.get('divergence')} ({info.get('tokens')} tokens, shipped)"] = (
            *draft_artifact.load_draft(recipe_dir, w.target, w.params), (runs / "recipe", False))
    return out


def stage_evaluate(c):
    out = pathlib.Path(c.out)
    prov = toolkit.provenance("experiments.distill.run", exclude=[out], config=c.to_dict())   # the start's
    tc = training_config("distill")
    gammas = tuple(range(1, c.max_gamma + 1))
    wc = ml_collections.ConfigDict(dict(workload=tc.target, dtype=tc.dtype, layers="fused", num_prompts=c.num_prompts,
                                        prompt_len=0, seed=0, init_std=0.02, max_new_tokens=c.max_new_tokens,
                                        repeats=c.repeats, verifier="token"))
    w = workload.load(wc, out / "_work")
    tok = models.load_tokenizer(tc.target)
    drafts = _drafts(c, w)
    probe = decoding.GenerationConfig(max_new_tokens=c.max_new_tokens, gamma=max(gammas))
    batches = [(p, decoding.make_batch([list(p.ids)], probe, jax.random.key(0), request_ids=[p.question_id],
                                       pad_multiple=c.pad_multiple)) for p in w.prompts]
    cap = max(b.capacity for _, b in batches)
    ctx = min(256, cap - max(gammas) - 2)
    jl = toolkit.Jsonl(out / "results.jsonl", {**prov, "model": w.name, "model_file": w.model_file,
                                               "model_sha256": w.model_sha256, "model_notes": w.notes,
                                               "prompt_ids": [p.question_id for p in w.prompts]})
    plan, full_head = None, distill.teacher_head(w.target, w.params, None)
    with toolkit.CompileLog() as log:
        t_k = {k: v["median_s"] for k, v in toolkit.forward_costs(
            w.target, w.params, [1] + [g + 1 for g in gammas], ctx=ctx, capacity=cap, iters=c.cost_iters,
            log=log).items()}
        jl.write("target_cost", t_k_s=t_k, context=ctx, capacity=cap)
        runner = measure.Runner(w, wc, log, w.eos_ids)
        _log("target-only runs")
        base = {}
        for p, b in batches:
            rec, _ = runner.run(measure.Method("target_only", "none", 0), 0.0, b)
            base[p.question_id] = rec
            jl.write("run", draft="none", question_id=p.question_id, category=p.category, **rec)
        base_tps = float(np.mean([r["tokens_per_s"] for r in base.values()]))
        for name, (m, p, where) in drafts.items():
            tf = _recorded_eval(*where, gammas=gammas) if where else None
            if tf is None:
                _log(f"{name}: teacher-forced evaluation")
                plan = plan or distill.eval_plan(tc, w.target, w.params, tok, log=_log)
                tf = distill.evaluate(m, p, full_head, plan, gammas)
            d_cost = toolkit.forward_costs(m, p, [1], ctx=ctx, capacity=cap, iters=c.cost_iters, log=log)[1]["median_s"]
            preds = {g: tf[f"greedy_tokens_per_pass_g{g}"] * t_k[1] / (g * d_cost + t_k[g + 1]) for g in gammas}
            best = max(gammas, key=preds.get)
            row = {"draft": name, "alpha_t1": tf["alpha_t1"], "greedy_agreement": tf["greedy_agreement"],
                   "sim_tokens_per_pass_by_gamma": {g: tf[f"greedy_tokens_per_pass_g{g}"] for g in gammas},
                   "predicted_by_gamma": preds, "best_gamma": best, "draft_step_over_target": d_cost / t_k[1],
                   "target_tokens_per_s": base_tps, "predicted_speedup": preds[best]}
            if not where:   # acceptance reference only: its speed is bench_speed's early_exit (shared cache)
                jl.write("summary", **row)
                continue
            w.drafters[name] = (drafters.ModelDrafter(m), p)
            runs = []
            for q, b in batches:
                rec, _ = runner.run(measure.Method(name, name, best), 0.0, b)
                runs.append(rec)
                jl.write("run", draft=name, gamma=best, question_id=q.question_id, category=q.category, **rec)
            per_pass = sum(r["committed"] for r in runs) / max(sum(r["rounds"] for r in runs), 1)
            tps = float(np.mean([r["tokens_per_s"] for r in runs]))
            row.update(engine_tokens_per_pass=per_pass, tokens_per_s=tps, speedup_of_means=tps / base_tps,
                       speedup_mean=float(np.mean([r["tokens_per_s"] / base[q.question_id]["tokens_per_s"]
                                                   for r, (q, _) in zip(runs, batches)])),
                       predicted_engine=per_pass * t_k[1] / (best * d_cost + t_k[best + 1]),
                       greedy_outputs_identical=all(r["generated_ids"] == base[q.question_id]["generated_ids"]
                                                    for r, (q, _) in zip(runs, batches)))
            _log(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}))
            jl.write("summary", **row)
            del w.drafters[name]
    jl.close()
    for wd in sorted(pathlib.Path(c.runs).iterdir()) if pathlib.Path(c.runs).is_dir() else []:
        if (wd / "metrics.jsonl").is_file():
            shutil.copy(wd / "metrics.jsonl", out / f"metrics-{wd.name}.jsonl")


def report(c):
    """results/README.md from results/results.jsonl alone."""
    out = pathlib.Path(c.out)
    recs = toolkit.read_jsonl(out / "results.jsonl")
    prov, rows = recs[0]["provenance"], [r for r in recs if r["kind"] == "summary"]
    cfg, f = prov["config"], toolkit.fmt
    g = str(cfg["gamma"])
    lines = ["# Distilled drafts for SmolLM2-135M-Instruct: held-out Spec-Bench evaluation", ""] + \
        toolkit.provenance_lines(prov) + [
        f"- engine: batch 1, float32, greedy, {cfg['max_new_tokens']} new tokens, median of {cfg['repeats']} "
        f"run(s); held-out question ids {prov['prompt_ids']}", "",
        "alpha: E[sum min(p, q)] at temperature 1; agreement: argmax q = argmax p; both teacher-forced on the target's "
        "greedy continuations of 4 held-out prompts per category. Tokens/pass: committed tokens per target forward "
        f"(sim: exact simulation from the agreement, at gamma = {g} and at the chosen gamma; engine: measured). The "
        f"engine runs each draft at the gamma in 1..{cfg['max_gamma']} with the highest predicted speedup. Predicted "
        "speedup: tokens/pass x t(target step) / (gamma t(draft step) + t(verify gamma+1)), step times measured in "
        "this run; *pred. (engine)* uses the engine's measured tokens/pass (it tests the cost model alone).", "",
        toolkit.table(
            ["draft", "alpha (T=1)", "greedy agreement", f"tokens/pass sim, gamma {g}", "chosen gamma",
             "tokens/pass sim", "tokens/pass engine", "draft cost / target", "tokens/s", "speedup (measured)",
             "speedup (predicted)", "pred. (engine)", "greedy output = target-only"],
            [[r["draft"], f(r["alpha_t1"], 3), f(r["greedy_agreement"], 3), f(r["sim_tokens_per_pass_by_gamma"][g]),
              r["best_gamma"], f(r["sim_tokens_per_pass_by_gamma"][str(r["best_gamma"])]),
              f(r.get("engine_tokens_per_pass")), f(r["draft_step_over_target"], 3),
              f"{f(r.get('tokens_per_s'), 1)} (target {f(r['target_tokens_per_s'], 1)})",
              f"{f(r.get('speedup_mean'))}x", f"{f(r['predicted_speedup'])}x", f"{f(r.get('predicted_engine'))}x",
              f(r.get("greedy_outputs_identical"))] for r in rows])]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main(c):
    stages = settings.stages(c)
    for stage in stages:
        {"compare": stage_compare, "recipe": stage_recipe, "evaluate": stage_evaluate, "report": report}[stage](c)


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"),
                             "experiments/distill/config.py")
