"""Tables (Markdown) from a bench_trees results.jsonl (`experiments.lib.tree_report`).

    python -m experiments.bench_trees.report experiments/bench_trees/results/results.jsonl
"""

from experiments.lib import tree_report

if __name__ == "__main__":
    tree_report.entry()
