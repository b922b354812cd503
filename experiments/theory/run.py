"""Theory vs measurement and the gamma sweep: the token-tree benchmark's run with this
directory's config, then the plots and tables from its JSONL (`plot`).

    python -m experiments.theory.run --config=experiments/theory/config.py
    python -m experiments.theory.run --config=experiments/theory/config.py:tiny     # CI size
"""

from __future__ import annotations

import pathlib

from experiments import toolkit
from experiments.bench_trees import run as trees_run
from experiments.theory import plot


def main(c):
    trees_run.run_variant(c, "experiments.theory.run", plot.plot)


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"),
                             "experiments/theory/config.py[:tiny]")
