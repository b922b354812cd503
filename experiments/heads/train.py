"""Train the feature-level draft heads for SmolLM2-135M-Instruct and export them here (issue 14).

    python -m experiments.heads.train [--kinds=eagle3,eagle,medusa] [--budget=N] [--workdir=DIR]
                                      [--eval_every=STEPS] [--name=NAME --set=KEY=VALUE ...]
                                      [--shards=responses_greedy,responses_sampled,...]

A run resumes from its workdir; a larger --budget there continues training (the cosine
schedule is laid out again over the new budget, so the learning rate restarts near its peak).

Each kind runs `specjax.distill.train` on configs/distill_head.py (EAGLE-3: three layers fused,
training-time test over 3 steps; EAGLE: last layer, feature regression weight 1; Medusa: 4
heads), resuming from its workdir, and exports the head to experiments/heads/<kind>/ (own
weights only, bfloat16) with the held-out evaluation in head.json and metrics in
experiments/heads/results/train-<kind>.jsonl. ``--name`` (one kind) runs a variant beside the
default one, e.g. ``--kinds=eagle --name=eagle-norm --set=head.input_norm=True``: workdir,
export and results under that name. ``--shards``: the data engine's answer stages as the only
data (streamed, `specjax.distill.ShardStream`), as the learning curve reads them.
"""

from __future__ import annotations

import json
import pathlib
import sys

from absl import app, flags

from configs import distill_head
from experiments.lib import engine_data, head_runs, toolkit
from experiments.heads import config as heads_config
from specjax import distill

KINDS = flags.DEFINE_list("kinds", list(heads_config.HEADS), "head kinds to train")
BUDGET = flags.DEFINE_integer("budget", 0, "loss tokens per head (0 = the config's)")
WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax-heads", "training workdirs (resumable)")
NAME = flags.DEFINE_string("name", "", "export to experiments/heads/<name>, results train-<name>.* and workdir "
                          "<workdir>/<name> ('' = the kind; one kind per run when set)")
SET = flags.DEFINE_multi_string("set", [], "config overrides KEY=VALUE (after the kind's), e.g. head.input_norm=True")
EVAL_EVERY = flags.DEFINE_integer("eval_every", 0, "steps between held-out evaluations (0 = the config's)")
SAMPLED = flags.DEFINE_integer("sampled_samples", -1, "target temperature-1 continuations per train prompt "
                               "(-1 = the config's)")
SHARDS = flags.DEFINE_list("shards", [], "train on these answer stages of the data engine's corpus "
                           "(experiments/data_engine/corpus/<stage>, e.g. responses_greedy,responses_sampled) "
                           "instead of the Spec-Bench train data, with the learning curve's length buckets")

OVERRIDES = {
    "eagle3": {},
    "eagle": {"head.ttt_steps": 1, "head.feature_weight": 1.0},
    "medusa": {"head.ttt_steps": 1},
    "parallel": {"head.ttt_steps": 1, "head.num_heads": 4},
}


def main(argv):
    del argv
    results = pathlib.Path("experiments/heads/results")
    results.mkdir(parents=True, exist_ok=True)
    if NAME.value and len(KINDS.value) != 1:
        raise app.UsageError("--name names one run: give one --kinds")
    for kind in KINDS.value:
        name = NAME.value or kind
        c = distill_head.get_config()
        c.draft.kind = kind
        distill.with_overrides(c, OVERRIDES[kind])
        for item in SET.value:
            key, sep, value = item.partition("=")
            if not sep:
                raise app.UsageError(f"--set wants KEY=VALUE, got {item!r}")
            try:
                parsed = json.loads(value.lower() if value in ("True", "False") else value)
            except ValueError:
                parsed = value              # a plain string, e.g. loss.divergence=jsd
            distill.with_overrides(c, {key: parsed})
        if BUDGET.value:
            c.budget_tokens = BUDGET.value
        if EVAL_EVERY.value:
            c.eval.every = EVAL_EVERY.value
        if SAMPLED.value >= 0:
            c.data.sampled_samples = SAMPLED.value
        if SHARDS.value:
            c.data.target_weight = 0.0
            c.data.shards.update(dirs=engine_data.stage_dirs(*SHARDS.value), weight=1.0, window=engine_data.WINDOW)
            c.data.widths = engine_data.WIDTHS
        c.export_dir = heads_config.head_dir(name)
        c.progress = False
        workdir = pathlib.Path(WORKDIR.value) / name
        summary = distill.train(c, workdir, log=lambda m: print(f"[{name}] {m}", flush=True))
        prov = toolkit.provenance("experiments.heads.train", exclude=[results, pathlib.Path(c.export_dir)],
                                  with_backend=False, config=c.to_dict())
        head_runs.write_summary(results, name, summary, prov, workdir / "metrics.jsonl")
        print(json.dumps(summary.get("eval"), indent=1), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    app.run(main)
