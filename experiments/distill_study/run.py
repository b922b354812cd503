"""The distillation study (issue 16): held-out acceptance of one draft before and after
distillation at a fixed budget of loss tokens, per divergence x data source x seed.

    python -m experiments.distill_study.run --config=experiments/distill_study/config.py
    python -m experiments.distill_study.plot [experiments/distill_study/results/results.jsonl]

Every run is `specjax.distill.train` on the study's training config (configs/distill_study.py)
with only the divergence, the data source's mixture weights and the seed changed, in its own
workdir under ``runs`` (a finished run is read back, not retrained; an interrupted one resumes
from its checkpoint). The first run also evaluates the starting draft (step 0), which is the
same in every run: the target's layers 0-2 and the target's rows of the same reduced head (its
tokens are picked from the target data, which every run loads, on-policy ones included).

Records (one JSONL, ``out``): ``setup`` (the training config, the sources' weights), ``start``
(the starting draft's held-out evaluation), one ``run`` per (source, divergence, seed): the
trainer's final held-out evaluation (alpha at temperature 1, greedy agreement, greedy committed
tokens per target pass at gamma 1-4), the train loss at the start and end, loss tokens per
source, on-policy refreshes and their seconds, wall seconds and training tokens/s; then
``results.md`` (`report.render`) and the plot (`plot.plot`) from that file alone.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import shutil
import time

from specjax import build, distill

from experiments.lib import toolkit
from experiments.distill_study import config as study_config
from experiments.distill_study import plot as study_plot
from experiments.distill_study import report


def _log(msg):
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def training_config(c, source: str, divergence: str, seed: int):
    """The training config of one run: `c.training_config` with the source's weights, the
    divergence, the seed and the study's common overrides."""
    if source not in study_config.SOURCES:
        raise ValueError(f"config.sources: {source!r} is not a data source; choose from {list(study_config.SOURCES)}")
    if divergence not in distill.DIVERGENCES:
        raise ValueError(f"config.divergences: {divergence!r} is not a divergence; choose from "
                         f"{list(distill.DIVERGENCES)}")
    over = {**study_config.SOURCES[source], "loss.divergence": divergence, "seed": int(seed),
            **distill.flatten(c.overrides.to_dict())}
    if c.target:
        over["target"] = c.target
    if c.data_root:
        over["data_root"] = c.data_root
    return distill.with_overrides(toolkit.load_config(c.training_config), over)


def run_name(source: str, divergence: str, seed: int) -> str:
    return f"{source}-{divergence}-seed{seed}"


# Keys a finished run may differ in and still be read back (they change no trained figure).
NOT_COMPARED = ("eval.at_start", "progress")


def _finished(workdir: pathlib.Path, tc) -> dict | None:
    """A finished run's summary when `workdir` holds one trained under exactly `tc` (else None:
    train). A run finished under another config, or an unreadable summary or config, is a
    ValueError naming the workdir and what differs: its figures are never reported as this
    config's."""
    f, stored = workdir / "final.json", workdir / "config.json"
    if not f.is_file():
        return None
    try:
        summary = json.loads(f.read_text())
        old = distill.flatten(distill.distill_settings(json.loads(stored.read_text())).to_dict())
    except (OSError, ValueError) as e:
        raise ValueError(f"{workdir}: unreadable finished run ({e}); delete the directory to train it again") from None
    new = distill.flatten(distill.distill_settings(tc).to_dict())
    diff = [f"{k}: {json.dumps(old.get(k))} -> {json.dumps(new.get(k))}" for k in sorted(set(old) | set(new))
            if k not in NOT_COMPARED and old.get(k) != new.get(k)]
    if diff:
        raise ValueError(f"{workdir} holds a run finished under another training config ({'; '.join(diff)}); "
                         f"delete it, or set config.runs to another directory")
    return summary if summary.get("tokens", 0) >= tc.budget_tokens else None


def run_record(workdir: pathlib.Path, summary: dict) -> dict:
    """What one finished run's metrics.jsonl and final.json say."""
    recs = toolkit.read_jsonl(workdir / "metrics.jsonl")
    train = [r for r in recs if r["kind"] == "train"]
    refreshes = [r for r in recs if r.get("event") == "onpolicy_refresh"]
    evals = [r for r in recs if r["kind"] == "eval"]
    after = summary["eval"]
    by_source: dict[str, int] = {}
    for r in train:
        by_source[r["source"]] = by_source.get(r["source"], 0) + int(r["loss_tokens"])
    k = max(1, min(3, len(train) // 4))        # train loss: mean of the first / last k steps
    return {
        "steps": summary["steps"], "tokens": summary["tokens"], "loss_tokens_by_source": by_source,
        "alpha_after": after["alpha_t1"], "agreement_after": after["greedy_agreement"],
        "tokens_per_pass_after": {g: after[f"greedy_tokens_per_pass_g{g}"] for g in range(1, 9)
                                  if f"greedy_tokens_per_pass_g{g}" in after},
        "eval_tokens": after["eval_tokens"],
        "train_loss_first": sum(r["loss"] for r in train[:k]) / k,
        "train_loss_last": sum(r["loss"] for r in train[-k:]) / k,
        "onpolicy_refreshes": len(refreshes), "onpolicy_s": sum(r["seconds"] for r in refreshes),
        "eval_s": sum(r["eval_s"] for r in evals if r["step"] > 0),
        "train_tokens_per_s": summary["train_tokens_per_s"], "wall_s": summary["wall_s"],
        "target_data_s": summary.get("target_data_s"),
    }


def start_eval(runs: pathlib.Path, names) -> dict | None:
    """The starting draft's evaluation (step 0) from the first run that has one."""
    for name in names:
        path = runs / name / "metrics.jsonl"
        if path.is_file():
            for r in toolkit.read_jsonl(path):
                if r["kind"] == "eval" and r["step"] == 0:
                    return r
    return None


def model_provenance(tc) -> dict:
    """The target's name, and for a registry name its (fetched, sha256-checked) GGUF file."""
    from specjax.models import registry
    if tc.target not in registry.KNOWN:
        return {"model": tc.target, "model_file": tc.target, "model_sha256": "", "model_notes": tc.dtype}
    return {"model": tc.target, "model_file": str(registry.resolve(tc.target)),
            "model_sha256": registry.KNOWN[tc.target].sha256, "model_notes": f"GGUF as {tc.dtype}"}


def main(c):
    if c.compilation_cache_dir:
        build.enable_compilation_cache(c.compilation_cache_dir)
    out = pathlib.Path(c.out)
    runs = pathlib.Path(c.runs)
    grid = list(itertools.product(c.seeds, c.sources, c.divergences))
    tcs = {(s, src, div): training_config(c, src, div, s) for s, src, div in grid}   # every name checked first
    first = tcs[grid[0]]
    prov = toolkit.provenance("experiments.distill_study.run", exclude=[out.parent], config=c.to_dict())
    jl = toolkit.Jsonl(out, {**prov, **model_provenance(first)})
    jl.write("setup", training_config=c.training_config, training=first.to_dict(), sources=dict(study_config.SOURCES),
             divergences=list(c.divergences), seeds=list(c.seeds), budget_tokens=first.budget_tokens)
    names = [run_name(src, div, s) for s, src, div in grid]
    for (s, src, div), name in zip(grid, names):     # before anything trains: no stale run is read back
        _finished(runs / name, tcs[(s, src, div)])
    t_study = time.perf_counter()
    for i, (seed, source, div) in enumerate(grid):
        tc, name = tcs[(seed, source, div)], run_name(source, div, seed)
        workdir = runs / name
        tc.eval.at_start = i == 0 and start_eval(runs, names) is None     # the shared start, evaluated once
        summary, reused = _finished(workdir, tc), True
        if summary is None:
            _log(f"[{i + 1}/{len(grid)}] {name}: training {tc.budget_tokens} loss tokens in {workdir}")
            summary, reused = distill.train(tc, workdir, log=lambda m, n=name: _log(f"[{n}] {m}")), False
        rec = run_record(workdir, summary)
        # The study keeps each run's metrics, config and summary; its checkpoints and on-policy
        # sets are not needed once the run is finished.
        for sub in ("checkpoints", "onpolicy"):
            shutil.rmtree(workdir / sub, ignore_errors=True)
        _log(f"{name}: alpha {rec['alpha_after']:.4f}, agreement {rec['agreement_after']:.4f}, "
             f"{rec['wall_s']:.0f} s{' (finished earlier)' if reused else ''}")
        jl.write("run", source=source, divergence=div, seed=int(seed), name=name, reused=reused, **rec)
    start = start_eval(runs, names)
    if start is None:
        raise RuntimeError(f"no step-0 evaluation in any of the study's runs under {runs}")
    jl.write("start", alpha=start["alpha_t1"], agreement=start["greedy_agreement"], eval_tokens=start["eval_tokens"],
             tokens_per_pass={g: start[f"greedy_tokens_per_pass_g{g}"] for g in range(1, 9)
                              if f"greedy_tokens_per_pass_g{g}" in start},
             study_wall_s=time.perf_counter() - t_study)
    jl.close()
    records = toolkit.read_jsonl(out)
    (out.parent / "results.md").write_text(report.render(records))
    for p in study_plot.plot(out):
        _log(f"wrote {p}")


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"),
                             "experiments/distill_study/config.py")
