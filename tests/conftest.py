"""Shared test setup: CPU only, the main command's XLA options with the backend's code
generation turned down, a per-run compilation cache, derandomized hypothesis."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Compilation dominates this suite on CPU (the head tests, then one file tests/test_heads.py: 138 s with an empty cache, 41 s
# with a warm one, AMD EPYC, 2 cores), and many modules and subprocesses compile the same
# programs. JAX's persistent compilation cache, in a directory that lives for one run (set
# here before jax is imported, so subprocesses started by tests inherit it), compiles each once.
# Point JAX_COMPILATION_CACHE_DIR elsewhere to keep a cache between runs.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _CACHE_DIR = tempfile.mkdtemp(prefix="specjax-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
    atexit.register(shutil.rmtree, _CACHE_DIR, True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# XLA's backend code generation turned down for the whole run (and the subprocesses tests start),
# as `_bench_run.FAST_COMPILE_XLA_FLAGS` says: the optimized HLO is the same, only LLVM's work on
# it is cut, so float rounding differs a little from a user's build and every exact comparison
# in the suite is between programs compiled with the same options. Measured on AMD EPYC, 2
# cores (two workers): the head tests + tests/test_engine_tree.py 581 -> 365 s; the
# real-model files (test_engine_real, test_long_prompt, test_gguf_parity, test_kernels) 596 ->
# 534 s, the 135M model's decode steps running a little slower unoptimized. The whole suite went
# over CI's 25 minutes without it (1737 s here). SPECJAX_TEST_XLA=full keeps XLA's defaults.
if os.environ.get("SPECJAX_TEST_XLA", "fast") != "full":
    from _bench_run import FAST_COMPILE_XLA_FLAGS  # noqa: E402

    _have = {f.split("=", 1)[0] for f in os.environ.get("XLA_FLAGS", "").split()}
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *(
        f for f in FAST_COMPILE_XLA_FLAGS.split() if f.split("=", 1)[0] not in _have)]).strip()

import hypothesis  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

from specjax import build  # noqa: E402

# The XLA CPU options of the main command (beside the fast-compile ones above).
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


# Tests of the real SmolLM2-135M-Instruct (its GGUF fetched on first use, ~100 MB, then cached):
# every test that uses one of these fixtures gets the marker, so `-m "not real_model"` runs the
# rest (tiny random models only) in a fraction of the time.
REAL_MODEL_FIXTURES = frozenset({"gguf_path", "real", "real_refs", "sj", "hf"})


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: loads the real SmolLM2-135M-Instruct (deselect with "
                                       "-m 'not real_model')")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
