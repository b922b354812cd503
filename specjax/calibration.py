"""Adaptive gamma's round times, calibrated once per machine and setting and cached on disk.

A calibration (`decoding.Generator.calibrate`) times one round per candidate gamma; the main
command stores the result under a key of the machine (`machine_key`) and the settings that
change round times (`setting_key`), and later runs with the same key reuse the median of the
last `KEEP_RUNS` calibrations instead of measuring again (`CalibrationCache`).
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import pathlib
import platform
import stat
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


ROUND_TIME_DTYPE = np.float32     # the dtype adaptive gamma keeps round times in (`decoding.PolicyState`)


def valid_round_time(t) -> bool:
    """Whether `t` is a round time adaptive gamma can use: a real number (not a bool) that is still
    finite and > 0 once cast to `ROUND_TIME_DTYPE`, the engine's dtype (a time that fits float64
    but overflows it to inf, or rounds to 0 in it, is not). The one check of the cache and the
    engine."""
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Real):
        return False
    try:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            v = np.asarray(t).astype(ROUND_TIME_DTYPE)
    except (OverflowError, TypeError, ValueError):      # an int too large for any float
        return False
    return bool(np.isfinite(v) and v > 0)


def round_time_table(round_time_s, choices, regimes: int) -> np.ndarray:
    """[regimes, len(choices)] round times (`ROUND_TIME_DTYPE`) for adaptive gamma: ``round_time_s``
    holds one entry per choice (every regime alike) or, for a drafter with several regimes, one
    per (regime, choice), regime-major (as `specjax.decoding.Engine.round_times` measures them);
    None gives the uncalibrated default, a round costing (1 + 0.1 gamma) target steps (gamma:
    a tree's depth) as for a cheap draft. Raises ValueError naming a bad entry or shape."""
    G, R = len(choices), regimes
    if round_time_s is None:
        rt = np.asarray([1.0 + 0.1 * (g if isinstance(g, int) else g.max_depth) for g in choices], ROUND_TIME_DTYPE)
        return np.broadcast_to(rt, (R, G))
    given = np.asarray(round_time_s)
    if given.dtype.kind not in "iuf" or not all(valid_round_time(t) for t in given.ravel()):
        dtype = np.dtype(ROUND_TIME_DTYPE).name
        raise ValueError(f"round_time_s must be finite and > 0 in {dtype} (seconds per round, "
                         f"`specjax.calibration.valid_round_time`), got {given.ravel().tolist()}")
    rt = given.astype(ROUND_TIME_DTYPE)
    if rt.shape == (G,):
        return np.broadcast_to(rt, (R, G))
    if rt.shape != (R * G,):
        raise ValueError(f"round_time_s needs one entry per gamma {tuple(choices)}"
                         + (f" or per (regime, gamma), {R} x {G}" if R > 1 else "") + f", got shape {rt.shape}")
    return rt.reshape(R, G)


def _valid_times(times) -> bool:
    return isinstance(times, list) and len(times) > 0 and all(valid_round_time(t) for t in times)


def _problem(data) -> str | None:
    """What keeps a cache file's data from the structure {key: {"fields": ..., "runs": [[t, ...],
    ...]}}, every run of an entry of one length, every time a `valid_round_time`; None if nothing."""
    if not isinstance(data, dict):
        return "not a calibration cache"
    for entry in data.values():
        if not (isinstance(entry, dict) and set(entry) == {"fields", "runs"} and isinstance(entry["runs"], list)
                and entry["runs"] and all(isinstance(r, list) and r for r in entry["runs"])
                and len({len(r) for r in entry["runs"]}) == 1):
            return "not a calibration cache"
        bad = [t for r in entry["runs"] for t in r if not valid_round_time(t)]
        if bad:
            return (f"a round time that is not a number finite and > 0 in {np.dtype(ROUND_TIME_DTYPE).name} "
                    f"(the engine's dtype): {_short(bad[0])}")
    return None


def _short(value) -> str:
    """`value` as a short string for a message (a huge integer by its number of digits)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def _not_regular(path: pathlib.Path) -> str | None:
    """What `path` is when it exists (following symlinks) and is not a regular file, e.g. "a
    character device"; None for a regular file, an absent path, or one that cannot be examined
    (reading it then reports why)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return _kind(mode)


def _kind(mode: int) -> str | None:
    """None for a regular file's st_mode, else what kind of file it is."""
    for test, name in ((stat.S_ISREG, None), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


class _NotRegular(OSError):
    """The opened path turned out not to be a regular file (it changed after the stat check)."""


def _read_regular(path: pathlib.Path) -> bytes:
    """The bytes of the regular file at `path`. Opening never blocks (a FIFO without a writer
    would block a plain open for ever) and anything but a regular file raises `_NotRegular`."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    with os.fdopen(fd, "rb") as f:
        kind = _kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise _NotRegular(kind)
        return f.read()


class CalibrationCache:
    """Round times per key in one JSON file: ``{key: {"fields": {...}, "runs": [[seconds per
    gamma], ...]}}``, the last `KEEP_RUNS` runs per key.

    ``path`` may use ``~``; "" disables the cache (`get` returns None, `put` stores nothing).
    Writes are atomic (a temporary file in the same directory, then `os.replace`): a reader sees
    the old file or the new one, and of two concurrent writers the last one wins. A file that
    cannot be read or does not hold the structure above (not JSON, another shape, a time that
    is not a `valid_round_time`, runs of different lengths) is never an error: it is renamed to
    ``<name>.corrupt`` (one line on stderr naming it and the problem) and the cache starts empty,
    so the times are measured again. A path that exists and is not a regular file (a device
    such as /dev/null, a FIFO, a directory; symlinks followed) turns the cache off: one line on
    stderr naming it, and it is never read, renamed or replaced. A file that cannot be written
    is one line on stderr as well."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path).expanduser() if str(path) else None
        self._off_said = False

    def _say(self, message: str) -> None:
        print(f"[specjax] calibration cache {self.path}: {message}", file=sys.stderr, flush=True)

    def _off(self, kind: str | None) -> bool:
        """True when the path is `kind` of file (not a regular one): the cache is off, said once."""
        if kind is None:
            return False
        if not self._off_said:
            self._say(f"{kind}, not a regular file: cache off (nothing read, written or renamed there)")
            self._off_said = True
        return True

    def _load(self) -> dict:
        if self.path is None or self._off(_not_regular(self.path)):
            return {}
        try:
            data = json.loads(_read_regular(self.path))
            problem = _problem(data)
            if problem is None:
                return data
        except FileNotFoundError:
            return {}
        except _NotRegular as e:                # changed into a FIFO, device... since the check
            self._off(str(e))
            return {}
        except (OSError, ValueError) as e:      # unreadable, not UTF-8, not JSON
            problem = f"unreadable ({type(e).__name__})"
        if self._off(_not_regular(self.path)):
            return {}
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
        """Add one calibration (seconds per gamma, each a `valid_round_time`) under `key`, with
        the fields it was measured for; keeps the last `KEEP_RUNS` runs of the key. Stores nothing
        when the cache is off (no path, or a path that is not a regular file)."""
        round_times = list(round_times)
        try:
            times = [float(t) for t in round_times]
        except (TypeError, ValueError, OverflowError):
            times = None
        if not _valid_times(times):
            raise ValueError(f"round times must be finite and > 0 in {np.dtype(ROUND_TIME_DTYPE).name} "
                             f"(the engine's dtype), got {[_short(t) for t in round_times]}")
        if self.path is None:
            return
        data = self._load()
        if self._off(_not_regular(self.path)):
            return
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
