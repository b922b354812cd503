"""What every experiment shares: timing, provenance, one JSONL writer, Markdown tables, and the
k-token forward / draft cost probes.

Timing: `timed` waits for every array of the result (`jax.block_until_ready`); `CompileLog`
sums the seconds jax spends tracing, lowering and compiling (`jax.monitoring` events), so a
warm-up reports its compile time apart and a timed call can be checked to compile nothing;
`time_calls` = one warm-up (compile recorded) then the median of `iters` timed calls.

Provenance (`provenance`): date, command line, git commit and dirty flag, the machine (CPU
model and its avx512 / bf16 / amx flags, cores, cgroup quota, memory, load), package versions,
jax backend and devices (`backend`), XLA_FLAGS, and what the caller adds (weights file and
sha256, the config). Take it first thing in a run, so the commit, dirty flag, date and load
are those of the start. Every JSONL record carries it (`Jsonl`), so one line says where it
came from.

Results (`Jsonl`): written to ``<file>.partial`` and moved over ``<file>`` on `close`, so a
results file always holds exactly one complete run; replacing an earlier run is reported.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib.util
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

from specjax.reporting import clean as _clean  # noqa: F401  (the JSON and table helpers live in specjax)
from specjax.reporting import fmt, table  # noqa: F401  (re-exported: toolkit.fmt, toolkit.table)
from ml_collections import config_flags

from specjax import decoding, drafters

REPO = pathlib.Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- timing

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


def median(xs) -> float:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else float("nan")


def timed(fn, *args, **kwargs):
    """(seconds, result) of one call, waiting for every array in the result."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return time.perf_counter() - t0, out


class CompileLog:
    """Compile seconds and backend compiles, overall and per `section()` (a dict filled on exit)."""

    def __init__(self):
        self.seconds, self.compiles = 0.0, 0

    def _listener(self, event: str, duration: float, **_):
        if event in _COMPILE_EVENTS:
            self.seconds += float(duration)
            self.compiles += event == _COMPILE_EVENTS[-1]

    def __enter__(self):
        self._cb = self._listener          # one bound method object: unregistered by identity
        jax.monitoring.register_event_duration_secs_listener(self._cb)
        return self

    def __exit__(self, *exc):
        with contextlib.suppress(AttributeError, ValueError, KeyError):
            jax.monitoring.unregister_event_duration_listener(self._cb)

    @contextlib.contextmanager
    def section(self):
        box, s0, c0 = {}, self.seconds, self.compiles
        try:
            yield box
        finally:
            box.update(compile_s=self.seconds - s0, compiles=self.compiles - c0)


def time_calls(fn, *args, iters: int, log: CompileLog) -> dict:
    """One warm-up call (its compile seconds recorded), then `iters` timed calls."""
    with log.section() as box:
        timed(fn, *args)
    ts = [timed(fn, *args)[0] for _ in range(iters)]
    return {"median_s": median(ts), "min_s": float(min(ts)), "compile_s": box["compile_s"]}


# ----------------------------------------------------------------------------- cost probes

def probe_tokens(batch: int, k: int, vocab_size: int) -> jax.Array:
    """Fixed [batch, k] token ids (a forward's cost does not depend on them)."""
    return (jnp.arange(batch * k, dtype=jnp.int32).reshape(batch, k) * 7 + 3) % vocab_size


def forward_costs(model, params, ks, *, ctx: int, capacity: int, iters: int, log: CompileLog, batch: int = 1) -> dict:
    """{k: median seconds of one jitted `model.apply` of k tokens per row} against a cache of
    `capacity` slots holding `ctx` tokens. Only the logits are returned, so the (not donated)
    cache is not copied; inside the decode loop the cache write is an in-place update of k slots."""
    if ctx + max(ks) > capacity:
        raise ValueError(f"context {ctx} + k {max(ks)} exceeds capacity {capacity}")
    cache = model.init_cache(batch, capacity).rollback(ctx)
    fn = jax.jit(lambda p, t, c: model.apply(p, t, c)[0])
    return {int(k): time_calls(fn, params, probe_tokens(batch, k, model.vocab_size), cache, iters=iters, log=log)
            for k in ks}


def prefill_costs(model, params, ks, *, iters: int, log: CompileLog) -> dict:
    """{k: median seconds of `specjax.models.prefill` of a k-token prompt (one chunk, batch 1)
    into a fresh cache of k slots}: what a prompt chunk costs, the head's logits not computed."""
    from specjax import models
    out = {}
    for k in ks:
        fn = jax.jit(lambda p, t, c: models.prefill(model, p, t, c, jnp.full((1,), t.shape[1], jnp.int32),
                                                    chunk=None, start_bound=0))
        out[int(k)] = time_calls(fn, params, probe_tokens(1, k, model.vocab_size), model.init_cache(1, k),
                                 iters=iters, log=log)
    return out


def propose_cost(target, drafter, draft_params, gamma: int, sampling, *, ctx: int, capacity: int, iters: int,
                 log: CompileLog, batch: int = 1, seed: int = 0) -> dict:
    """Seconds of one jitted `drafter.propose` of `gamma` tokens per row at context `ctx`: the
    drafter prefilled on a random context, the target's cache holding ctx - 1 tokens (a feature
    head: random target features of its width at every position)."""
    rng = np.random.default_rng(seed)
    tokens_BS = jnp.asarray(rng.integers(0, target.vocab_size, (batch, capacity)), jnp.int32)
    lengths_B = jnp.full((batch,), ctx, jnp.int32)
    layers = tuple(getattr(drafter, "feature_layers", ()) or ())
    features = None
    if layers:
        width = len(layers) * target.config.hidden_size
        features = jnp.asarray(rng.standard_normal((batch, capacity, width)), jnp.float32)
        state = jax.jit(lambda dp, t, n, f: drafter.init(dp, t, n, capacity, features_BPF=f))(
            draft_params, tokens_BS[:, :ctx], lengths_B, features[:, :ctx])
    else:
        state = jax.jit(lambda dp, t, n: drafter.init(dp, t, n, capacity))(draft_params, tokens_BS[:, :ctx], lengths_B)
    context = drafters.DraftContext(tokens_BS=tokens_BS, lengths_B=lengths_B,
                                    target_cache=target.init_cache(batch, capacity).rollback(ctx - 1),
                                    features=features)
    keys = decoding.request_keys(jax.random.key(seed), list(range(batch)))
    fn = jax.jit(lambda dp, st, cx, ky, sp: drafter.propose(dp, st, cx, ky, gamma, sp)[:2])
    return time_calls(fn, draft_params, state, context, keys, sampling, iters=iters, log=log)


# ----------------------------------------------------------------------------- provenance

def git_state(exclude=()) -> dict:
    """HEAD's commit and whether the tree differs from it, ignoring paths under `exclude`."""
    def git(*args):
        try:
            p = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30,
                               env=dict(os.environ, GIT_OPTIONAL_LOCKS="0"))
            return p.stdout if p.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None
    commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=all")
    if status is None:
        return {"git_commit": commit and commit.strip(), "git_dirty": None, "git_changed_files": None}
    skip = []                                 # repo-relative files or folders
    for e in exclude:
        with contextlib.suppress(ValueError):
            skip.append(pathlib.Path(e).resolve().relative_to(REPO).as_posix().rstrip("/"))
    changed = [line[3:].strip('"') for line in status.splitlines() if line.strip()]
    changed = [c for c in changed if not any(c == p or c.startswith(p + "/") for p in skip)]
    return {"git_commit": commit and commit.strip(), "git_dirty": bool(changed), "git_changed_files": changed[:50]}


def _read(path: str) -> str:
    try:
        return pathlib.Path(path).read_text()
    except OSError:
        return ""


def loadavg() -> list[float] | None:
    """1, 5 and 15 minute load averages (a busy machine makes every timing unreliable)."""
    fields = _read("/proc/loadavg").split()[:3]
    return [float(x) for x in fields] if fields else None


def cpu_quota() -> float | None:
    """CPUs allowed by the cgroup (v2 cpu.max or v1 cfs quota); None if unlimited or unknown."""
    v2 = _read("/sys/fs/cgroup/cpu.max").split()
    if len(v2) == 2:
        return None if v2[0] == "max" else int(v2[0]) / int(v2[1])
    q, p = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").strip(), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us").strip()
    return int(q) / int(p) if q and p and int(q) > 0 else None


def machine() -> dict:
    """The host (no jax backend is started: see `backend`)."""
    cpuinfo = _read("/proc/cpuinfo").splitlines()
    field = lambda name: next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith(name)), "")  # noqa: E731
    flags = field("flags").split()
    mem = next((int(ln.split()[1]) for ln in _read("/proc/meminfo").splitlines() if ln.startswith("MemTotal:")), 0)
    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "numpy", "ml_collections", "torch", "transformers", "specjax"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[pkg] = metadata.version(pkg)
    return {
        "cpu_model": field("model name") or platform.processor() or platform.machine(),
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx512", "amx")) or "bf16" in f or f in ("avx2", "fma")),
        "cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)), "cgroup_cpu_quota": cpu_quota(),
        "mem_total_gib": round(mem / 2 ** 20, 1), "loadavg_at_start": loadavg(), "platform": platform.platform(),
        "python": platform.python_version(), "versions": versions, "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def backend() -> dict:
    """jax's backend and devices (this starts the backend: on a GPU it takes its memory)."""
    devices = jax.devices()
    return {"jax_backend": jax.default_backend(),
            "devices": f"{len(devices)} x {getattr(devices[0], 'device_kind', devices[0].platform)}"}


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def provenance(module: str, *, exclude=(), with_backend: bool = True, **extra) -> dict:
    """The block every record of a run carries; `module` names the entry point (``python -m``).
    Call it at the start of a run; with ``with_backend=False`` the jax backend is left unstarted
    (add `backend()` to ``["machine"]`` later, e.g. after a child process that needs the device)."""
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": f"python -m {module} {shlex.join(sys.argv[1:])}".strip(),
            **git_state(exclude), "machine": {**machine(), **(backend() if with_backend else {})}, **extra}


def load_config(path, *args):
    """``get_config(*args)`` of a config file (a path, relative to the repository or absolute),
    with the drafter kinds' keys in a generation config, as the CLI reads it
    (`specjax.config_files.with_drafter_keys`)."""
    path = REPO / path
    if not path.is_file():
        raise FileNotFoundError(f"no config file {path}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from specjax import config_files
    return config_files.with_drafter_keys(module.get_config(*args))


# ----------------------------------------------------------------------------- JSONL

class OutputError(Exception):
    """An output a run cannot write (an empty path, a directory where the file goes, a file on
    the way, no permission, another process writing it, a full disk): one line naming the path,
    said before the long work where it can be known (`main_with_config` prints it alone)."""


def check_output(setting: str, path) -> None:
    """``path`` (a results file, created with its folders if absent) can be written: OutputError
    naming ``setting`` otherwise, before anything runs."""
    from specjax import files
    if not str(path).strip():
        raise OutputError(f"{setting}={str(path)!r}: empty; name the file to write")
    p = pathlib.Path(path).expanduser()
    problem = files.path_problem(p, want_dir=False) or files.dir_problem(str(p.parent))
    if problem:
        raise OutputError(f"{setting}={str(path)!r}: {problem}; nothing was run")


def append_records(module: str, measure, out, setting: str = "--out") -> list[dict]:
    """A diagnostic script's run: ``measure()``'s records appended to the JSONL ``out`` (earlier
    runs stay above), each with the run's provenance (taken before it runs, the backend left
    for it to start; the load average at its end added). A path that cannot be written is an
    `OutputError` naming ``setting``, before anything runs."""
    check_output(setting, out)
    path = pathlib.Path(out).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{setting}={str(out)!r}: {e.strerror or e}; nothing was run") from None
    prov = provenance(module, with_backend=False)
    rows = measure()
    prov["loadavg_at_end"] = list(os.getloadavg())
    try:
        with open(path, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({**r, "provenance": prov}, default=str) + "\n")
    except OSError as e:
        raise OutputError(f"{setting}={str(out)!r}: {e.strerror or e}; the records are printed above and the "
                          f"file keeps its earlier runs") from None
    return rows


class Jsonl:
    """The one JSONL writer: one object per line, ``{"kind": ..., fields..., "provenance": ...}``.

    One file holds one run: records go to ``<path>.partial`` (flushed per record, for a look
    while it runs) and `close` moves it over `path`, saying on stderr when that replaces an
    earlier run. A run that dies leaves the earlier results in place and its own in ``.partial``;
    a new run (not resuming it) first moves that aside to ``.partial.prev``. While a run writes,
    it holds an OS lock on ``<path>.lock`` (released if it dies), so a second process on the same
    file stops at once with one line. A path that cannot be written, or a write that fails (a
    full disk), is an `OutputError` naming the file and what is kept."""

    def __init__(self, path, provenance: dict, keep: list[dict] = (), setting: str = "config.out"):
        """``keep``: records of an earlier, unfinished run of the same command to carry over as
        they are (each with its own provenance), written first (a run that resumes)."""
        import fcntl
        check_output(setting, path)
        self.path = pathlib.Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.provenance = _clean(provenance)
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self._lock = open(self._lock_path, "a+", encoding="utf-8")
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "another process"
            self._lock.close()
            raise OutputError(f"{setting}={str(path)!r}: {holder} is writing this file; wait for it or choose "
                              "another output (two runs in one file overwrite each other)") from None
        except OSError:         # a file system without locks: run unlocked
            pass
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"pid {os.getpid()} ({' '.join(sys.argv)[:200]})\n")
        self._lock.flush()
        self._n = 0
        try:
            if keep:        # the resumed records, complete on disk before the old partial goes
                fresh = self.partial.with_name(self.partial.name + ".new")
                with open(fresh, "w", encoding="utf-8") as f:
                    f.writelines(json.dumps(rec) + "\n" for rec in keep)
                os.replace(fresh, self.partial)
                self._f = open(self.partial, "a", encoding="utf-8")
                self._n = len(keep)
            else:
                if self.partial.is_file() and self.partial.stat().st_size:
                    prev = self.partial.with_name(self.partial.name + ".prev")
                    os.replace(self.partial, prev)
                    print(f"[toolkit] {self.partial}: an unfinished earlier run, moved to {prev}", file=sys.stderr,
                          flush=True)
                self._f = open(self.partial, "w", encoding="utf-8")
        except OSError as e:
            self._release()
            raise OutputError(f"{self.partial}: cannot be written ({e.strerror}); {self.path} is untouched") from e

    def write(self, kind: str, **fields) -> dict:
        rec = {"kind": kind, **_clean(fields), "provenance": self.provenance}
        try:
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()
        except OSError as e:
            raise OutputError(f"{self.partial}: writing record {self._n + 1} failed ({e.strerror}); the {self._n} "
                              f"before it are in that file, {self.path} still holds the earlier run") from e
        self._n += 1
        return rec

    def close(self):
        try:
            self._f.close()
            if self.path.is_file() and self.path.stat().st_size:
                old = read_jsonl(self.path)
                prov = old[0].get("provenance", {}) if old else {}
                print(f"[toolkit] {self.path}: replaced an earlier run ({len(old)} records, commit "
                      f"{prov.get('git_commit')}, {prov.get('date_utc')}); git keeps it if it was committed",
                      file=sys.stderr, flush=True)
            os.replace(self.partial, self.path)
        except OSError as e:
            raise OutputError(f"{self.partial}: could not be completed or moved to {self.path} ({e.strerror}); "
                              f"its {self._n} records stay in {self.partial}") from e
        finally:
            self._release()

    def _release(self):
        if not self._lock.closed:
            with contextlib.suppress(OSError):
                self._lock_path.unlink()
            self._lock.close()


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- Markdown

def provenance_lines(prov: dict) -> list[str]:
    """The provenance block as Markdown bullet lines."""
    m = prov["machine"]
    dirty = {True: " (working tree dirty)", False: "", None: " (dirty state unknown)"}[prov.get("git_dirty")]
    out = [f"- date (UTC): {prov['date_utc']}; command: `{prov['command']}`",
           f"- git commit: `{prov.get('git_commit')}`{dirty}"]
    if prov.get("model"):
        out.append(f"- model: `{prov['model']}`, weights `{prov.get('model_file')}`, "
                   f"sha256 `{prov.get('model_sha256')}` ({prov.get('model_notes', '')})")
    quota = f" (cgroup quota {m['cgroup_cpu_quota']:g})" if m.get("cgroup_cpu_quota") else ""
    out += [f"- machine: {m['cpu_model']} ({' '.join(m['cpu_flags']) or 'no avx512/amx'}), {m['cpus_usable']} usable "
            f"of {m['cpu_count']} CPUs{quota}, {m['mem_total_gib']} GiB; {m['devices']} ({m['jax_backend']}); "
            f"load average at start {m['loadavg_at_start']}",
            "- versions: python " + m["python"] + ", " + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
            + (f"; XLA_FLAGS `{m['xla_flags']}`" if m.get("xla_flags") else "")]
    return out


# ----------------------------------------------------------------------------- plots

def model_label(name) -> str:
    """A plot title's name for a target: the default model's full name, else what was given."""
    return "SmolLM2-135M-Instruct" if "smollm2" in str(name or "").lower() else str(name or "?")


def drafter_label(drafter: str) -> str:
    """'head:<dir>' as '<last dir> head', other drafter kinds as they are."""
    return drafter.split("/")[-1] + " head" if drafter.startswith("head:") else drafter


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (plots are written, never shown)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def run_caption(prov: dict) -> str:
    """'<CPU model> (<n> CPUs), commit <sha>' of a provenance block, for plot titles."""
    m = prov.get("machine", {})
    return f"{m.get('cpu_model', '?')} ({m.get('cpus_usable', '?')} CPUs), commit {str(prov.get('git_commit', '?'))[:8]}"


def save_figure(fig, path) -> pathlib.Path:
    """Lay out, write (PNG, 110 dpi) and close a matplotlib figure; returns its path."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return pathlib.Path(path)


# ----------------------------------------------------------------------------- entry point

def main_with_config(main, default_config, help: str) -> None:
    """Run ``main(config)`` as an absl program with ``--config=<file>[:variant]`` (and
    ``--config.key=value`` overrides). The flag is defined here, when the program starts, and
    not at import, so experiments (and the CLI) can be imported side by side, e.g. by tests.
    Before ``main``, the main command's XLA CPU options and backend choice (`build.tune_xla_cpu`:
    no libtpu start-up errors where libtpu is installed but no TPU exists), as every specjax
    entry point does."""
    flag = config_flags.DEFINE_config_file("config", str(default_config), help)

    def run(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        from specjax import build
        build.tune_xla_cpu()
        try:
            main(flag.value)
        except OutputError as e:         # one line, not a traceback
            sys.exit(f"error: {e}")

    app.run(run)
