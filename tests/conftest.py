"""Shared test setup: CPU only, the main command's XLA options, derandomized hypothesis."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

from specjax import build  # noqa: E402

# The XLA CPU options of the main command, so tests compile what users run.
build.tune_xla_cpu()

# Property tests are derandomized so CI is reproducible; the examples still vary per test.
hypothesis.settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=60, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile("ci")
