"""Theory vs measurement and the gamma sweep: the token-tree benchmark's run with this
directory's config, then the plots and tables from its JSONL (`plot`).

    python -m experiments.theory.run --config=experiments/theory/config.py
    python -m experiments.theory.run --config=experiments/theory/config.py:tiny     # CI size
"""

from experiments.lib.tree_study import study

main, _entry = study("theory")

if __name__ == "__main__":
    _entry()
