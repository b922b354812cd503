"""The temperature sweep: the token-tree benchmark's run with this directory's config, then the
plot and table from its JSONL (`plot`).

    python -m experiments.temperature.run --config=experiments/temperature/config.py
    python -m experiments.temperature.run --config=experiments/temperature/config.py:tiny    # CI size
"""

from __future__ import annotations

import pathlib

from experiments import toolkit
from experiments.bench_trees import run as trees_run
from experiments.temperature import plot


def main(c):
    trees_run.run_variant(c, "experiments.temperature.run", plot.plot)


if __name__ == "__main__":
    toolkit.main_with_config(main, pathlib.Path(__file__).with_name("config.py"),
                             "experiments/temperature/config.py[:tiny]")
