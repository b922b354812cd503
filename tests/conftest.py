"""Shared test setup: CPU only, derandomized hypothesis, and paths to shared data."""
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402
import pytest  # noqa: E402

from specjax import build  # noqa: E402

# The XLA CPU options of the main command, so tests compile what users run.
build.tune_xla_cpu()

# Property tests are derandomized so CI is reproducible; the examples still vary per test.
hypothesis.settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=60, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile("ci")

REPO = pathlib.Path(__file__).resolve().parents[1]
SPEC_BENCH = REPO.parent / "shared" / "data" / "spec_bench_question.jsonl"


@pytest.fixture(scope="session")
def spec_bench_path():
    if not SPEC_BENCH.is_file():
        raise FileNotFoundError(f"Spec-Bench questions not found at {SPEC_BENCH}")
    return SPEC_BENCH
