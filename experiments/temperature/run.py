"""The temperature sweep: the token-tree benchmark's run with this directory's config, then the
plot and table from its JSONL (`plot`).

    python -m experiments.temperature.run --config=experiments/temperature/config.py
    python -m experiments.temperature.run --config=experiments/temperature/config.py:tiny    # CI size
"""

from experiments.lib.tree_study import study

main, _entry = study("temperature")

if __name__ == "__main__":
    _entry()
