"""Shared test setup: CPU only, the main command's XLA options with the backend's code
generation turned down, a per-run compilation cache, derandomized hypothesis."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One intra-op thread for PyTorch (the transformers references) and OpenMP/BLAS libraries, in
# this process and the subprocesses it starts: the suite runs one worker per core, where torch's
# thread pool mostly spins on the tiny references. XLA's own thread pool is not affected. (Times
# with and without: the README's tests row.)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import atexit  # noqa: E402
import collections  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Compilation dominates this suite on CPU (experiments/suite_time), and many modules and
# subprocesses compile the same programs. JAX's persistent compilation cache, in a directory that lives for one run (set
# here before jax is imported, so subprocesses started by tests inherit it), compiles each once.
# Point JAX_COMPILATION_CACHE_DIR elsewhere to keep a cache between runs.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _CACHE_DIR = tempfile.mkdtemp(prefix="specjax-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
    atexit.register(shutil.rmtree, _CACHE_DIR, True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# XLA's backend code generation turned down for the tests of tiny models (and the subprocesses
# tests start), as `_bench_run.FAST_COMPILE_XLA_FLAGS` says: LLVM's work cut (JAX's
# `jax_disable_most_optimizations`, which sets XLA's backend optimization level 0 and no expensive
# LLVM passes per compilation), fusions emitted by XLA's older IR emitters and the LLVM module
# compiled in one piece (no split for parallel code generation: both cores run workers); the optimized HLO is
# the same up to a few fusion decisions, so float rounding differs a little from a user's build and
# every exact comparison in a test is between programs compiled with the same options. Compilation
# is most of a tiny model's test time; the real SmolLM2's programs (scanned layers: the backend's
# work is nearly the same either way) run several times slower unoptimized, so the tests marked
# `real_model` compile with the backend's default optimization, except those marked
# `fast_compile` (`pytest_runtest_setup` below;
# times: the README's tests row). SPECJAX_TEST_XLA=full keeps XLA's defaults everywhere.
FAST_XLA = os.environ.get("SPECJAX_TEST_XLA", "fast") != "full"
if FAST_XLA:
    from _bench_run import FAST_COMPILE_XLA_FLAGS  # noqa: E402

    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    _have = {f.split("=", 1)[0] for f in os.environ.get("XLA_FLAGS", "").split()}
    # `jax_disable_most_optimizations` holds the other two of FAST_COMPILE_XLA_FLAGS
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *(
        f for f in FAST_COMPILE_XLA_FLAGS.split()
        if f.split("=", 1)[0] not in _have | {"--xla_backend_optimization_level", "--xla_llvm_disable_expensive_passes"})]
    ).strip()

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


# The order of the files for pytest-xdist's `--dist loadfile` (whole files per worker): the
# longest first, so that the run ends on short files and both workers finish together. xdist
# would otherwise start with the files of most tests and end with the one-test files, which are
# the long subprocess runs (each worker also holds up to 3 such files queued at the end).
# The weights are each file's relative cost (its worker-seconds in a profiled run of the suite,
# SPECJAX_TEST_PROFILE below and experiments/suite_time); a file not listed weighs
# FILE_SECONDS_PER_TEST per test. Only the order
# depends on them: a stale weight costs balance, never a result.
FILE_SECONDS = {
    "test_server.py": 122, "test_tree_verify.py": 90, "test_gguf_parity.py": 86, "test_heads_train.py": 75,
    "test_sampled_exactness.py": 73, "test_engine_real.py": 63, "test_engine_tree.py": 63, "test_kernels.py": 62,
    "test_sampling_penalties.py": 59, "test_cli_commands.py": 58, "test_constraints.py": 52,
    "test_families.py": 51, "test_engine_distribution.py": 51, "test_multiprocess.py": 48,
    "test_parallel_drafter.py": 48, "test_block_step_bitwise.py": 44, "test_pallas_attention.py": 43,
    "test_aot.py": 43, "test_sharded_train.py": 41, "test_heads_sampling.py": 39, "test_distill.py": 39,
    "test_load_study.py": 39, "test_datagen.py": 38, "test_sharded_engine.py": 37, "test_long_prompt.py": 37,
    "test_distill_study.py": 36, "test_bench_speed.py": 36, "test_cpu_levers.py": 35, "test_heads_engine.py": 33,
    "test_heads_greedy.py": 32, "test_cli.py": 31, "test_bad_input_round4_cli.py": 30, "test_heads_hybrid.py": 28,
    "test_eagle3_formats.py": 27, "test_suffix.py": 25, "test_buckets.py": 25, "test_sampling_rows.py": 24,
    "test_serving_live.py": 24, "test_heads_features.py": 23, "test_theory_temperature.py": 21,
    "test_greedy_bf16.py": 20, "test_engine_edges.py": 20, "test_distill_resume.py": 18, "test_serving.py": 18,
    "test_bench_gpu.py": 16, "test_engine_greedy.py": 15,
}
FILE_SECONDS_PER_TEST = 0.5


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: loads the real SmolLM2-135M-Instruct (deselect with "
                                       "-m 'not real_model')")
    config.addinivalue_line("markers", "fast_compile: a real_model test that still compiles with the backend's "
                                       "optimization turned down (its matmuls are the CPU kernel's custom calls, "
                                       "which XLA's optimization does not touch, in unrolled layers)")
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope") and not hasattr(config, "workerinput"):
        config.option.loadscopereorder = False     # keep the order pytest_collection_modifyitems makes


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Each test compiles with the optimization its model wants (see FAST_XLA above); set before
    the test's fixtures, so a module's shared references compile as its tests do."""
    if FAST_XLA:
        optimize = item.get_closest_marker("real_model") is not None and item.get_closest_marker("fast_compile") is None
        jax.config.update("jax_disable_most_optimizations", not optimize)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
    if hasattr(config, "workerinput"):            # an xdist worker: the files longest first
        files = [item.nodeid.split("::")[0] for item in items]
        per_test = collections.Counter(files)
        cost = {f: FILE_SECONDS.get(f.rpartition("/")[2], FILE_SECONDS_PER_TEST * n) for f, n in per_test.items()}
        order = {id(item): -cost[f] for item, f in zip(items, files)}
        items.sort(key=lambda item: order[id(item)])      # stable: each file's tests keep their order


# SPECJAX_TEST_PROFILE=DIR: each test's seconds spent tracing, lowering and compiling JAX programs in
# this process (JAX's monitoring events; subprocesses the test starts are not counted), one JSONL
# file per worker, to tell compilation from execution when trimming the suite.
_PROFILE_DIR = os.environ.get("SPECJAX_TEST_PROFILE")
if _PROFILE_DIR:
    import json
    import time

    _COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                       "/jax/core/compile/backend_compile_duration")
    _compile_s = collections.Counter()

    def _on_duration(event, duration, **_):
        if event in _COMPILE_EVENTS:
            _compile_s[event.rpartition("/")[2]] += duration

    jax.monitoring.register_event_duration_secs_listener(_on_duration)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _compile_s.clear()
        start = time.perf_counter()
        yield
        os.makedirs(_PROFILE_DIR, exist_ok=True)
        with open(os.path.join(_PROFILE_DIR, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"test": item.nodeid, "wall_s": round(time.perf_counter() - start, 3),
                                **{k: round(v, 3) for k, v in _compile_s.items()}}) + "\n")
