"""The studies' one library: `toolkit` (provenance, timing, JSONL, figures, the config runner),
`workload` (targets, drafters and prompts as the benchmarks build them), `tree_study`,
`tree_config` and `tree_report` (the token-tree study every tree and temperature study runs).
A study folder holds a config, a thin runner and its results, and imports from here (and
specjax) only, never from another study (`tests/test_layering.py`)."""
