"""Settings of the token-tree benchmark (`python -m experiments.bench_trees.run --config=<this file>[:tiny]`);
the defaults live in `experiments.lib.tree_config`, which the other tree studies extend."""

from experiments.lib.tree_config import get_config  # noqa: F401
