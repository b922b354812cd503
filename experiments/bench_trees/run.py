"""The token-tree benchmark (the runner lives in `experiments.lib.tree_study`).

    python -m experiments.bench_trees.run --config=experiments/bench_trees/config.py        # ~50 min on 2 cores
    python -m experiments.bench_trees.run --config=experiments/bench_trees/config.py:tiny   # CI size, a minute
"""

from experiments.lib import tree_study

if __name__ == "__main__":
    tree_study.entry()
