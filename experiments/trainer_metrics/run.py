"""Trainer steps/s with metrics read at once against one step late (`metrics_lag` 0 / 1).

    python -m experiments.trainer_metrics.run --workloads=toy --steps=300 --repeats=3
    python -m experiments.trainer_metrics.run --workloads=smollm2_eagle --steps=20 --repeats=1

Each workload trains the same run with ``metrics_lag`` = 0 and 1, alternately, `repeats` times
in one process; steps/s is measured after the first `warmup` steps (compilation) from the
training records (``elapsed_s``: when step i's metrics reached the host). Workloads:

* ``toy``: a tiny random target (vocabulary 64, width 32, 3 layers), a standalone 1-layer draft
  on random token sequences: short steps, where host work per step shows;
* ``smollm2_eagle``: an EAGLE head on SmolLM2-135M-Instruct, trained on the data engine's greedy
  answer shards (configs/distill_head.py), the target's forward inside each step.

Writes results/trainer_metrics.jsonl (one record per run; a run of some workloads keeps the
others' records), results/README.md and a plot.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import jax
import numpy as np
from absl import app, flags

from experiments.lib import toolkit

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKLOADS = flags.DEFINE_list("workloads", ["toy", "smollm2_eagle"], "toy | smollm2_eagle")
REPEATS = flags.DEFINE_integer("repeats", 2, "runs per lag and workload, alternating")
STEPS = flags.DEFINE_integer("steps", 60, "training steps per run")
WARMUP = flags.DEFINE_integer("warmup", 5, "steps left out of the rate (compilation)")
OUT = flags.DEFINE_string("out", str(HERE / "results"), "results directory")


def _toy_config(root: pathlib.Path, steps: int):
    from configs import distill
    from specjax import models
    from specjax.distill import with_overrides
    target = root / "target"
    if not target.is_dir():
        cfg = models.ModelConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                                 head_dim=8, ffn_size=64, max_position=256)
        model = models.Llama(cfg)
        params = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, model.init_params(jax.random.key(0)))
        models.export_hf(model, params, target)
        rng = np.random.default_rng(0)
        with open(root / "data.jsonl", "w") as f:
            for _ in range(256):
                toks = rng.integers(0, 64, int(rng.integers(12, 60))).tolist()
                f.write(json.dumps({"tokens": toks, "prompt_length": int(rng.integers(1, 8))}) + "\n")
    return with_overrides(distill.get_config(), {
        "target": str(target), "data_root": str(root / "cache"), "data.target_weight": 0.0, "data.fixed_weight": 1.0,
        "data.fixed_jsonl": str(root / "data.jsonl"), "data.widths": (32, 64), "data.tokens_per_batch": 256,
        "draft.layers": (0,), "draft.head_vocab": 0, "optim.learning_rate": 3e-3, "optim.warmup_steps": 3, "budget_tokens": 10 ** 9, "checkpoint_every": 10 ** 6, "eval.every": 0,
        "eval.at_start": False, "progress": False, "export_dir": ""})


def _head_config(root: pathlib.Path, steps: int):
    from configs import distill_head
    from specjax.distill import with_overrides
    h = distill_head.get_config()
    h.draft.kind = "eagle"
    h.data.target_weight = 0.0
    h.data.shards.update(dirs=(str(REPO / "experiments/data_engine/corpus/responses_greedy"),), weight=1.0)
    return with_overrides(h, {"budget_tokens": 10 ** 9, "checkpoint_every": 10 ** 6, "eval.every": 0,
                              "eval.at_start": False, "progress": False, "export_dir": "",
                              "data_root": str(root / "cache")})


CONFIGS = {"toy": _toy_config, "smollm2_eagle": _head_config}


def steps_per_s(records: list[dict], warmup: int) -> float:
    """Steps per second between step `warmup` and the last (``elapsed_s``: when a step's
    metrics reached the host, since the loop began)."""
    train = [r for r in records if r["kind"] == "train"]
    t = {r["step"]: r["elapsed_s"] for r in train}
    a, b = warmup, train[-1]["step"]
    return (b - a) / (t[b] - t[a])


def main(_):
    from specjax import distill
    out = pathlib.Path(OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    prov = toolkit.provenance("experiments.trainer_metrics.run")
    recs = []
    with tempfile.TemporaryDirectory(prefix="specjax-trainer-metrics-") as tmp:
        for name in WORKLOADS.value:
            root = pathlib.Path(tmp) / name
            root.mkdir()
            for rep in range(REPEATS.value):
                for lag in (0, 1):
                    c = CONFIGS[name](root, STEPS.value)
                    c.metrics_lag = lag
                    work = root / f"work-{lag}-{rep}"
                    distill.train(c, work, log=lambda *_: None, stop_after_steps=STEPS.value)
                    rs = toolkit.read_jsonl(work / "metrics.jsonl")
                    rec = {"workload": name, "metrics_lag": lag, "repeat": rep, "steps": STEPS.value,
                           "warmup": WARMUP.value, "steps_per_s": steps_per_s(rs, WARMUP.value), **prov}
                    print(f"{name} lag={lag} repeat={rep}: {rec['steps_per_s']:.2f} steps/s", flush=True)
                    recs.append(rec)
    path = out / "trainer_metrics.jsonl"      # other workloads' records from earlier runs are kept
    kept = [r for r in (toolkit.read_jsonl(path) if path.is_file() else []) if r["workload"] not in WORKLOADS.value]
    recs = kept + recs
    path.write_text("".join(json.dumps(r, default=str) + "\n" for r in recs))
    report(recs, out)


def report(recs: list[dict], out: pathlib.Path) -> None:
    prov = recs[0]
    rows, ratios = [], {}
    for name in dict.fromkeys(r["workload"] for r in recs):
        one = next(r for r in recs if r["workload"] == name)
        rows_note = f"{one['steps']} steps, {sum(r['workload'] == name for r in recs) // 2} repeats"
        rate = {lag: float(np.median([r["steps_per_s"] for r in recs if r["workload"] == name
                                      and r["metrics_lag"] == lag])) for lag in (0, 1)}
        ratios[name] = rate[1] / rate[0]
        rows.append(f"| {name} | {rows_note} | {rate[0]:.2f} | {rate[1]:.2f} | {ratios[name]:.3f} |")
    plt = toolkit.pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(list(ratios), list(ratios.values()))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("steps/s, lag 1 / lag 0")
    ax.set_title(toolkit.run_caption(prov), fontsize=7)
    toolkit.save_figure(fig, out / "trainer_metrics.png")
    lines = ["# Trainer steps/s: metrics read at once (lag 0) against one step late (lag 1)", "",
             "```bash", "python -m experiments.trainer_metrics.run --workloads=toy --steps=300 --repeats=3",
             "python -m experiments.trainer_metrics.run --workloads=smollm2_eagle --steps=20 --repeats=1", "```", "",
             "Median steps/s over the repeats, measured after the warm-up steps, both lags alternating in one "
             "process (`run.py` says how).", "",
             "| workload | run | lag 0 steps/s | lag 1 steps/s | ratio |", "|---|---|---:|---:|---:|", *rows, "",
             ""]
    for name in dict.fromkeys(r["workload"] for r in recs):
        lines += [f"Provenance of the {name} runs:", "", *toolkit.provenance_lines(
            next(r for r in recs if r["workload"] == name)), ""]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
