"""The verifier comparison: the token-tree benchmark's run with this directory's config, then the
plot and table from its JSONL (`plot`).

    python -m experiments.verifiers.run --config=experiments/verifiers/config.py
    python -m experiments.verifiers.run --config=experiments/verifiers/config.py:tiny      # CI size
"""

from experiments.lib.tree_study import study

main, _entry = study("verifiers")

if __name__ == "__main__":
    _entry()
