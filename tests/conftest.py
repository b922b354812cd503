"""Shared test setup: CPU only, the main command's XLA options, derandomized hypothesis."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc  # noqa: E402

import hypothesis  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

from specjax import build  # noqa: E402

# The XLA CPU options of the main command, so tests compile what users run.
build.tune_xla_cpu()

# Property tests are derandomized so CI is reproducible; the examples still vary per test.
hypothesis.settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=40, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile("ci")


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Free every compiled program after each test module. One process keeping all of them
    (hundreds of programs over the suite) exhausts vm.max_map_count (65530 here) and XLA then
    crashes inside compilation (see experiments/bench_speed/PROFILE.md)."""
    yield
    jax.clear_caches()
    gc.collect()
