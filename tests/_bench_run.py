"""Run an experiments/ entry point end to end on CPU in a subprocess (CI smoke tests)."""
import json
import math
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

# XLA CPU options for subprocesses of the tests (and, through tests/conftest.py, the test
# processes themselves): the backend's code generation turned down, and fusions emitted by XLA's
# older LLVM IR emitters instead of its MLIR fusion emitters (`--xla_cpu_use_fusion_emitters=false`),
# whose pipeline costs far more than these tiny programs' execution, and the LLVM module compiled
# in one piece (`--xla_cpu_parallel_codegen_split_count=1`: with every core running a test, the
# split for parallel code generation only adds work; times: the README's tests row). The optimized HLO (SPMD partitioning, copy insertion) is the
# same up to a few fusion decisions; float rounding differs a little (a tiny Llama's logits by up
# to ~5e-6 relative here), so a test that uses it compares exactly only with programs compiled
# the same way, and otherwise within a tolerance (each test's docstring says which).
FAST_COMPILE_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                          "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")



def default_xla_env(**extra) -> dict:
    """This process's environment without the suite's fast compilation (XLA_FLAGS and JAX's
    JAX_DISABLE_MOST_OPTIMIZATIONS, tests/conftest.py): a subprocess compiles as a user's build does."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")}
    return {**env, **extra}


def run_module(module: str, args, out: pathlib.Path, timeout: int = 300, records_file: str = "results.jsonl"):
    """(out, JSONL records of out/records_file, stdout) of ``python -m module *args --config.out=out``,
    compiled fast (XLA's backend optimisation turned down: the numbers of these runs mean nothing)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=FAST_COMPILE_XLA_FLAGS,
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", module, *args, f"--config.out={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    records = [json.loads(line) for line in (out / records_file).read_text().splitlines() if line.strip()]
    return out, records, proc.stdout


def positive(x) -> bool:
    """A finite number > 0 (not a bool): what every measured time, rate and size must be."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def run_script_on_devices(script: str, *args, devices: int = 8, timeout: int = 600) -> str:
    """stdout of ``python -c script *args`` in a process with ``devices`` simulated CPU devices
    (compiled fast, see `FAST_COMPILE_XLA_FLAGS`), run from the repository root; fails the test
    with the end of its output when it exits non-zero."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_XLA_FLAGS}",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r.stdout
