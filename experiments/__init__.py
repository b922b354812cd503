"""Experiments: benchmarks and studies built on specjax (not part of the package)."""
