"""Export a finished learning-curve point's head, e.g. to ship it (`experiments.heads.ship`).

    python -m experiments.learning_curve.export --config=experiments/learning_curve/config.py \\
        --config.workdir=DIR --kind=eagle3 --size=2200000 --to=experiments/heads/eagle3-engine

The point's workdir (``DIR/<kind>-<size>``) must hold its finished training under this config;
its head (own weights, head.json with the data tokens and the held-out evaluation) goes to
``--to`` (an existing head there is replaced only with ``--force``). Nothing is trained.
``--summary=NAME`` also writes the point's training summary as
experiments/heads/results/train-NAME.json(l), which gives the head its row in TRAINING.md.
"""

import pathlib
import shlex
import sys

from absl import flags

from experiments.learning_curve import run
from experiments.lib import head_runs, toolkit

KIND = flags.DEFINE_string("kind", None, "head kind of the point (eagle, eagle3)", required=True)
SIZE = flags.DEFINE_integer("size", None, "data size of the point (loss tokens, one of config.sizes)", required=True)
TO = flags.DEFINE_string("to", None, "directory to write the head to", required=True)
FORCE = flags.DEFINE_boolean("force", False, "replace a head already in --to")
SUMMARY = flags.DEFINE_string("summary", "", "also write the point's training summary as "
                              "experiments/heads/results/train-<this name>.json(l), for the heads' training table")


def main(c):
    results = toolkit.REPO / "experiments/heads/results"
    if SUMMARY.value:                    # an existing summary is refused before anything is written
        head_runs.summary_path(results, SUMMARY.value, overwrite=False)
    out = run.export_point(c, KIND.value, SIZE.value, pathlib.Path(TO.value), force=FORCE.value)
    print(f"exported {KIND.value} at {SIZE.value:,} -> {out['dir']} ({out['bytes'] / 1e6:.1f} MB, sha256 {out['sha256']})")
    if SUMMARY.value:
        path = run.write_summary(c, KIND.value, SIZE.value, out, results,
                                 SUMMARY.value, command="python -m experiments.learning_curve.export "
                                 + shlex.join(sys.argv[1:]))
        print(f"training summary -> {path}")


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"), "learning-curve settings")
