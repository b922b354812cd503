"""The verifier comparison: the token-tree benchmark's run with this directory's config, then the
plot and table from its JSONL (`plot`).

    python -m experiments.verifiers.run --config=experiments/verifiers/config.py
    python -m experiments.verifiers.run --config=experiments/verifiers/config.py:tiny      # CI size
"""

from __future__ import annotations

import pathlib

from experiments import toolkit
from experiments.bench_trees import run as trees_run
from experiments.verifiers import plot


def main(c):
    trees_run.main(c, module="experiments.verifiers.run")
    # The benchmark's own table (it writes README.md beside the JSONL) as bench_trees.md.
    results = pathlib.Path(c.out).parent
    (results / "README.md").replace(results / "bench_trees.md")
    for p in plot.plot(c.out):
        print(p)


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"),
                             "experiments/verifiers/config.py[:tiny]")
