"""python -m specjax.distill --config=configs/distill.py --workdir=DIR [--config.budget_tokens=...]

Runs or resumes (same command) a distillation in DIR; see `specjax.distill.train`.
"""

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "distillation config (configs/distill*.py)")
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: checkpoints, metrics.jsonl, final.json")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    from specjax import build
    build.tune_xla_cpu()
    from specjax.distill import train
    train(_CONFIG.value, _WORKDIR.value)


def run():
    app.run(main)


if __name__ == "__main__":
    run()
