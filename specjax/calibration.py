"""Adaptive gamma's round times, calibrated once per machine and setting and cached on disk.

A calibration (`decoding.Generator.calibrate`) times one round per candidate gamma; the main
command stores the result under a key of the machine (`machine_key`) and the settings that
change round times (`setting_key`), and later runs with the same key reuse the median of the
last `KEEP_RUNS` calibrations instead of measuring again (`CalibrationCache`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import platform
import sys
import tempfile

import jax
import numpy as np

KEEP_RUNS = 5                               # calibrations kept per key; `get` is their median


def _cpu() -> tuple[str, list[str]]:
    """(CPU model name, CPU flags) from /proc/cpuinfo, else platform's processor and no flags."""
    model, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = value.split()
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def machine_key() -> dict:
    """What makes round times of this machine differ from another's: the CPU model and its vector
    flags (avx2, fma, avx512*, amx*, *bf16*), the usable cores, JAX's default backend (which this
    starts) and its first device's kind, the jax and jaxlib versions and `specjax.kernels.isa()`."""
    import jaxlib

    from specjax import kernels
    model, flags = _cpu()
    vector = sorted({f for f in flags if f in ("avx2", "fma") or f.startswith(("avx512", "amx")) or "bf16" in f})
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cpu_flags": vector, "cores": cores, "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "kernel_isa": kernels.isa()}


def setting_key(**fields) -> str:
    """sha256 hex of sorted JSON of `machine_key` and the caller's fields (JSON values; anything
    else is written with `str`): equal settings on one machine give equal keys."""
    text = json.dumps({"machine": machine_key(), "setting": fields}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _valid_times(times) -> bool:
    return (isinstance(times, list) and len(times) > 0
            and all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
                    for t in times))


def _valid(data) -> bool:
    """A cache file's structure: {key: {"fields": ..., "runs": [[t, ...], ...]}}, every run of
    an entry of one length, every time finite and > 0."""
    if not isinstance(data, dict):
        return False
    for entry in data.values():
        if not (isinstance(entry, dict) and set(entry) == {"fields", "runs"} and isinstance(entry["runs"], list)
                and entry["runs"] and all(_valid_times(r) for r in entry["runs"])
                and len({len(r) for r in entry["runs"]}) == 1):
            return False
    return True


class CalibrationCache:
    """Round times per key in one JSON file: ``{key: {"fields": {...}, "runs": [[seconds per
    gamma], ...]}}``, the last `KEEP_RUNS` runs per key.

    ``path`` may use ``~``; "" disables the cache (`get` returns None, `put` stores nothing).
    Writes are atomic (a temporary file in the same directory, then `os.replace`): a reader sees
    the old file or the new one, and of two concurrent writers the last one wins. A file that
    cannot be read or does not hold the structure above (not JSON, another shape, a time that
    is not finite and > 0, runs of different lengths) is never an error: it is renamed to
    ``<name>.corrupt`` (one line on stderr) and the cache starts empty. A file that cannot be
    written is one line on stderr as well."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path).expanduser() if str(path) else None

    def _say(self, message: str) -> None:
        print(f"[specjax] calibration cache {self.path}: {message}", file=sys.stderr, flush=True)

    def _load(self) -> dict:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_bytes())
            if _valid(data):
                return data
            problem = "not a calibration cache"
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:      # unreadable, not UTF-8, not JSON
            problem = f"unreadable ({type(e).__name__})"
        aside = self.path.with_name(self.path.name + ".corrupt")
        try:
            os.replace(self.path, aside)
            self._say(f"{problem}; set aside as {aside.name}, starting empty")
        except OSError as e:
            self._say(f"{problem}; could not set it aside ({e}), starting empty")
        return {}

    def get(self, key: str) -> tuple[float, ...] | None:
        """The per-entry median of the runs stored under `key` (one entry per gamma, or per draft
        source and gamma), or None."""
        entry = self._load().get(key)
        return None if entry is None else tuple(float(t) for t in np.median(np.asarray(entry["runs"]), axis=0))

    def put(self, key: str, fields: dict, round_times) -> None:
        """Add one calibration (seconds per gamma, each finite and > 0) under `key`, with the
        fields it was measured for; keeps the last `KEEP_RUNS` runs of the key."""
        times = [float(t) for t in round_times]
        if not _valid_times(times):
            raise ValueError(f"round times must be finite and > 0, got {times}")
        if self.path is None:
            return
        data = self._load()
        runs = [r for r in data.get(key, {}).get("runs", []) if len(r) == len(times)] + [times]
        data[key] = {"fields": fields, "runs": runs[-KEEP_RUNS:]}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, prefix=self.path.name + ".",
                                             suffix=".tmp", delete=False) as f:
                tmp = f.name
                json.dump(data, f, sort_keys=True, indent=1, default=str)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            self._say(f"not written ({e})")
