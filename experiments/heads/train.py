"""Train the feature-level draft heads for SmolLM2-135M-Instruct and export them here (issue 14).

    python -m experiments.heads.train [--kinds=eagle3,eagle,medusa] [--budget=N] [--workdir=DIR]

Each kind runs `specjax.distill.train` on configs/distill_head.py (EAGLE-3: three layers fused,
training-time test over 3 steps; EAGLE: last layer, feature regression weight 1; Medusa: 4
heads), resuming from its workdir, and exports the head to experiments/heads/<kind>/ (own
weights only, bfloat16) with the held-out evaluation in head.json and metrics in
experiments/heads/results/train-<kind>.jsonl.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

from absl import app, flags

from configs import distill_head
from experiments import toolkit
from experiments.heads import config as heads_config
from specjax import distill

KINDS = flags.DEFINE_list("kinds", list(heads_config.HEADS), "head kinds to train")
BUDGET = flags.DEFINE_integer("budget", 0, "loss tokens per head (0 = the config's)")
WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax-heads", "training workdirs (resumable)")
SAMPLED = flags.DEFINE_integer("sampled_samples", -1, "target temperature-1 continuations per train prompt "
                               "(-1 = the config's)")

OVERRIDES = {
    "eagle3": {},
    "eagle": {"head.ttt_steps": 1, "head.feature_weight": 1.0},
    "medusa": {"head.ttt_steps": 1},
}


def main(argv):
    del argv
    results = pathlib.Path("experiments/heads/results")
    results.mkdir(parents=True, exist_ok=True)
    for kind in KINDS.value:
        c = distill_head.get_config()
        c.draft.kind = kind
        distill.with_overrides(c, OVERRIDES[kind])
        if BUDGET.value:
            c.budget_tokens = BUDGET.value
        if SAMPLED.value >= 0:
            c.data.sampled_samples = SAMPLED.value
        c.export_dir = heads_config.head_dir(kind)
        c.progress = False
        workdir = pathlib.Path(WORKDIR.value) / kind
        summary = distill.train(c, workdir, log=lambda m: print(f"[{kind}] {m}", flush=True))
        shutil.copy(workdir / "metrics.jsonl", results / f"train-{kind}.jsonl")
        prov = toolkit.provenance("experiments.heads.train", exclude=[results, pathlib.Path(c.export_dir)],
                                  with_backend=False, config=c.to_dict())
        (results / f"train-{kind}.json").write_text(json.dumps({"summary": summary, "provenance": prov},
                                                               indent=1, default=str))
        print(json.dumps(summary.get("eval"), indent=1), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    app.run(main)
