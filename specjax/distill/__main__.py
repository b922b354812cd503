"""python -m specjax.distill --config=configs/distill.py --workdir=DIR [--config.budget_tokens=...]

The same as ``specjax distill ...``: runs or resumes (same command) a distillation in DIR; see
`specjax.distill.train`.
"""

import sys


def run():
    from specjax import cli
    cli.run(["specjax", "distill", *sys.argv[1:]])


if __name__ == "__main__":
    run()
