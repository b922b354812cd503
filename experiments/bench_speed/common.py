"""Timing helpers, compile accounting, provenance and the JSONL writer."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import jax

REPO = pathlib.Path(__file__).resolve().parents[2]

# Events jax records while it traces, lowers and compiles a jitted function (jax._src.dispatch).
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


# ----------------------------------------------------------------------------- timing

def median(xs) -> float:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else float("nan")


def timed(fn: Callable, *args, **kwargs):
    """(seconds, result) of one call, waiting for every array in the result."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


class CompileLog:
    """Sums the seconds jax spends tracing, lowering and compiling, via jax.monitoring.

    `section()` gives the compile seconds and backend-compile count of a block of code, so a
    configuration's warm-up can report its compile time and a timed run can assert that it
    did not compile anything (a recompilation would otherwise hide inside the timing).
    """

    def __init__(self):
        self.seconds = 0.0
        self.compiles = 0
        self._registered = False
        self._callback = self._listener   # one bound-method object: unregistered by identity

    def _listener(self, event: str, duration: float, **_):
        if event in _COMPILE_EVENTS:
            self.seconds += float(duration)
            if event == _BACKEND_COMPILE:
                self.compiles += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._callback)
        self._registered = True
        return self

    def __exit__(self, *exc):
        if self._registered:
            try:
                jax.monitoring.unregister_event_duration_listener(self._callback)
            except (AttributeError, ValueError, KeyError):
                pass
            self._registered = False

    @contextlib.contextmanager
    def section(self):
        box = {"compile_s": 0.0, "compiles": 0}
        s0, c0 = self.seconds, self.compiles
        try:
            yield box
        finally:
            box["compile_s"] = self.seconds - s0
            box["compiles"] = self.compiles - c0


# ----------------------------------------------------------------------------- provenance

def _git(*args) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.rstrip("\n").strip("\n") if out.returncode == 0 else None   # keep porcelain's leading spaces


def git_state(exclude=()) -> dict:
    """HEAD's commit and whether the working tree differs from it (`git status --porcelain`),
    ignoring paths under `exclude` (the benchmark's own output directory)."""
    commit = _git("rev-parse", "HEAD")
    commit = commit.strip() if commit else commit
    status = _git("status", "--porcelain", "--untracked-files=all")
    if status is None:
        return {"git_commit": commit, "git_dirty": None, "git_changed_files": None}
    prefixes = []
    for e in exclude:
        try:
            prefixes.append(pathlib.Path(e).resolve().relative_to(REPO).as_posix().rstrip("/") + "/")
        except ValueError:      # outside the repository: cannot show up in git status
            pass
    changed = [line[3:] for line in status.splitlines() if line.strip()]
    changed = [c for c in changed if not any(c.strip('"').startswith(p) for p in prefixes)]
    return {"git_commit": commit, "git_dirty": bool(changed), "git_changed_files": changed[:50]}


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    try:
        from importlib import metadata
        return metadata.version(module)
    except Exception:  # not installed
        return None


def loadavg() -> list[float] | None:
    """1, 5 and 15 minute load averages (a busy machine makes every timing here unreliable)."""
    try:
        return [float(x) for x in pathlib.Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def cpu_quota() -> float | None:
    """CPUs allowed by the cgroup's CPU quota (v2 cpu.max or v1 cfs), None if unlimited/unknown."""
    try:
        quota, period = pathlib.Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(pathlib.Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(pathlib.Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def machine() -> dict:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    mem_gib = None
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2 ** 20, 1)
    except OSError:
        pass
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "cgroup_cpu_quota": cpu_quota(),
        "loadavg_at_start": loadavg(),
        "mem_total_gib": mem_gib,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "flax": _version("flax"),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


# ----------------------------------------------------------------------------- output

def _clean(x: Any) -> Any:
    """JSON-safe: numpy scalars/arrays to Python, NaN/inf to None."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = dataclasses.asdict(x)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return _clean(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    return x


class JsonlWriter:
    """One JSON object per line; every record carries the run's provenance block."""

    def __init__(self, path: pathlib.Path, provenance: dict):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.provenance = provenance
        self.records: list[dict] = []
        self._f = open(self.path, "w", encoding="utf-8")

    def write(self, kind: str, **fields) -> dict:
        rec = _clean({"kind": kind, **fields, "provenance": self.provenance})
        self._f.write(json.dumps(rec, sort_keys=False) + "\n")
        self._f.flush()
        self.records.append(rec)
        return rec

    def close(self):
        self._f.close()


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
