"""All checkpointing in one place: an Orbax `CheckpointManager` over a work directory.

A checkpoint holds two items: ``state`` (any pytree of arrays, e.g. the distillation
`TrainState`) and ``meta`` (JSON: what produced it, data position, token counts). Saves are
asynchronous (the next steps run while the arrays are written). Orbax writes each step into a
temporary directory and renames it when complete, so a process killed mid-save leaves no step
that looks finished.

What is restored is verified. Once a save has completed (at the next `save`, `wait` or
`close`), a manifest ``<step>/specjax_checksums.json`` records the size and sha256 of every
file of the step directory. `restore_latest` goes from the newest step down; a step is used
when its files match its manifest, Orbax restores it, and every floating-point leaf of the
restored state is finite. Each step it passes over is reported in one line (printed, and
returned in ``skipped``), with what happens to it:

* corrupt (a file missing, truncated or changed, an unreadable manifest, a non-finite state,
  or, for a step without a manifest, any Orbax failure): deleted once an older step has
  restored, so that the resumed run can save that step number again;
* a read error (``OSError``) is retried once; if it persists, or the files match their
  manifest but Orbax still fails, or the saved shapes/dtypes differ from the template (read
  from the step's metadata, before any array is read), the step is intact or possibly so: it
  is moved, whole, to ``<directory>.kept/<step>`` (never deleted) and the path is reported;
* a step without a manifest (saved by an older version, or the process died between the
  save and its manifest) is restored unverified (finiteness only) and says so.

A save that fails on the file system (a full disk, the file size limit, a read-only file
system) raises where it is awaited (`save` of the next step, `wait`, `close`) as an `OSError`
naming the file, Orbax's own report of it (its thread's traceback, the closed event loop's
callbacks) left out; the step stays a temporary directory, never taken for a finished one.

If no step restores, nothing is deleted or moved and `restore_latest` raises. Corruption caught
by the checksums never reaches Orbax, so its failed-restore noise ("Event loop is closed"
tracebacks from coroutines a failed async read leaves behind) does not appear; it can still
appear for a damaged step that has no manifest.

Retention is ours, not Orbax's (``max_to_keep`` is off): after a save completes the newest
`keep` steps are kept, and an older step is deleted only when it is older than the newest
step verified good in this process (restored with matching checksums, or saved and hashed
here), which is itself never deleted. A checkpoint that may be the last good one therefore
survives however many newer, unverified or corrupt, steps follow it.

Sharded and multi-process: a state of sharded `jax.Array`s is saved as it lies (each process
writes its own shards; Orbax coordinates the processes), and `restore_latest(template)` restores
onto the template's shardings, so a checkpoint written on one mesh restores on another mesh or
on one device. In a job of several processes every process calls `save` / `restore_latest` /
`wait` / `close` in the same order (Orbax's barriers need all of them); process 0 alone writes
the checksum manifests and moves steps aside, and every process takes the same decisions (they
read the same files, and wait for each other before any step is deleted or moved; a read error
seen by one process only is not reconciled: it could make them disagree). The checkpoint
directory must then be one shared file system path seen by all processes (NFS, a GCS FUSE
mount, or one machine's disk for local runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import re
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from specjax.files import file_sha256

MANIFEST = "specjax_checksums.json"


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    meta: dict
    skipped: list[tuple[int, str]]       # (step, error) of newer checkpoints that failed
    kept: list[tuple[int, str]] = dataclasses.field(default_factory=list)   # (step, where it was moved)


class CorruptCheckpoint(Exception):
    """The step's bytes are not what was saved (or the restored state is not finite)."""


class _Transient(Exception):
    """Reading the step failed with an I/O error; the step may well be intact."""


# The manifest's digest (a module-level name so fault-injection tests can wrap the reader).
_file_digest = file_sha256


def _files(step_dir: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.startswith(MANIFEST))


def write_manifest(step_dir: pathlib.Path) -> None:
    step_dir = pathlib.Path(step_dir)
    files = {rel: {"bytes": (step_dir / rel).stat().st_size, "sha256": _file_digest(step_dir / rel)}
             for rel in _files(step_dir)}
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"version": 1, "files": files}, indent=0, sort_keys=True))
    os.replace(tmp, step_dir / MANIFEST)


def verify_manifest(step_dir: pathlib.Path) -> bool:
    """True if every file listed in the step's manifest has its recorded size and sha256; False if
    there is no manifest. Raises CorruptCheckpoint (naming the file) or _Transient (an I/O error)."""
    path = pathlib.Path(step_dir) / MANIFEST
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return False
    except OSError as e:
        raise _Transient(f"read error: {MANIFEST}: {e}") from None
    try:
        files = json.loads(text)["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no files listed")
    except Exception:  # noqa: BLE001 - any damage to the manifest is corruption
        raise CorruptCheckpoint(f"{MANIFEST} is damaged") from None
    for rel, rec in sorted(files.items()):
        f = pathlib.Path(step_dir) / rel
        try:
            size = f.stat().st_size
            if size != rec["bytes"]:
                raise CorruptCheckpoint(f"{rel}: {size} bytes, {rec['bytes']} saved")
            got = _file_digest(f)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{rel}: missing") from None
        except OSError as e:
            raise _Transient(f"read error: {rel}: {e}") from None
        if got != rec["sha256"]:
            raise CorruptCheckpoint(f"{rel}: sha256 {got[:12]}…, {rec['sha256'][:12]}… saved")
    return True


def _nonfinite_leaf(state) -> str | None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.extended):
            continue                       # (typed PRNG keys)
        if not np.issubdtype(np.dtype(leaf.dtype), np.inexact):
            continue
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            ok = bool(_all_finite_jit(leaf))     # a reduction over the global array (replicated result)
        else:
            ok = bool(np.isfinite(np.asarray(jax.device_get(leaf))).all())
        if not ok:
            return jax.tree_util.keystr(path) or "<root>"
    return None


@jax.jit
def _all_finite_jit(x):
    return jax.numpy.all(jax.numpy.isfinite(x))


def _primary() -> bool:
    return jax.process_index() == 0


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


_OS_CODE = re.compile(r"os_error_code='?(\d+)")
_FAILED_PATH = re.compile(r'(?:Failed writing|local file):? "([^"]+)"')     # the last one named is the file


def os_error_of(e: BaseException, where) -> OSError | None:
    """The OS error inside a failed save, as an `OSError` naming a path (None when it is not
    one): an OSError without a file name gets `where`; Orbax's tensorstore writes fail with a
    ValueError whose text holds ``[os_error_code='28']`` and the file (``Failed writing:
    "PATH"``), which becomes ``OSError(28, 'No space left on device', PATH)``."""
    if isinstance(e, OSError):
        if e.filename is not None:
            return e
        if e.errno is not None:
            return OSError(e.errno, e.strerror or os.strerror(e.errno), str(where))
        return None
    m = _OS_CODE.search(str(e))
    if m is None:
        return None
    code = int(m.group(1))
    paths = _FAILED_PATH.findall(str(e))
    return OSError(code, os.strerror(code), paths[-1] if paths else str(where))


@contextlib.contextmanager
def _os_errors(where):
    """Raise an OS failure of Orbax (a full disk, the file size limit, a read-only file system)
    as the `OSError` it is (`os_error_of`), naming the file; other errors pass unchanged."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised, as an OSError when it is one
        err = os_error_of(e, where)
        if err is None or err is e:
            raise
        raise err from e


class _QuietOrbaxOSErrors(logging.Filter):
    """Orbax's background save thread logs a failure with its traceback at ERROR, then the
    failure is raised again where the save is awaited (`Checkpointer.save` / `wait` / `close`,
    as an `OSError` naming the file): the thread's copy of an OS failure is dropped, so that a
    full disk is one line, not a traceback and a line. Other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in (record.pathname or "") or not record.exc_info:
            return True
        return _OS_CODE.search(str(record.exc_info[1])) is None and not isinstance(record.exc_info[1], OSError)


_QUIET = _QuietOrbaxOSErrors()


class _QuietLostWriteFutures(logging.Filter):
    """asyncio's "Future exception was never retrieved" for a tensorstore write that failed with
    an OS error (``os_error_code``) after Orbax stopped awaiting the step's other writes: the
    failure is raised where the save is awaited; its orphaned siblings are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception was never retrieved" not in str(record.msg):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        text = str(exc) if exc is not None else record.getMessage()
        return _OS_CODE.search(text) is None


_QUIET_FUTURES = _QuietLostWriteFutures()


def _closed_loop_callback(unraisable) -> bool:
    """An "Event loop is closed" RuntimeError of a tensorstore callback: after a failed
    asynchronous write or read, Orbax closes its event loop while the other writes of the step
    still finish and call back into it, each reported as unraisable (a traceback apiece, no
    message). The failure itself is raised where the save or restore is awaited."""
    exc = unraisable.exc_value
    if not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
        return False
    tb = unraisable.exc_traceback
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        tb = tb.tb_next
    return False


def _install_quiet_hooks() -> None:
    """Orbax's noise around a failed save: the background thread's logged traceback of an OS
    failure (`_QuietOrbaxOSErrors`) and the closed event loop's callbacks
    (`_closed_loop_callback`); everything else reaches the previous hooks."""
    import sys
    if _QUIET not in logging.getLogger("absl").filters:      # Orbax logs through absl's logger
        logging.getLogger("absl").addFilter(_QUIET)
    if _QUIET_FUTURES not in logging.getLogger("asyncio").filters:
        logging.getLogger("asyncio").addFilter(_QUIET_FUTURES)
    previous = sys.unraisablehook
    if getattr(previous, "_specjax_quiet", False):
        return

    def hook(unraisable):
        if not _closed_loop_callback(unraisable):
            previous(unraisable)
    hook._specjax_quiet = True
    sys.unraisablehook = hook


class Checkpointer:
    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).resolve()
        self.keep = max(1, int(keep))
        _install_quiet_hooks()
        with _os_errors(self.directory):
            self.manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                                     enable_async_checkpointing=async_save))
        self._good: set[int] = set()       # steps verified good in this process
        self._pending: list[int] = []      # saved; manifest to write once the save has completed

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def _step_dir(self, step: int) -> pathlib.Path:
        return self.directory / str(int(step))

    def _settle(self) -> None:
        """After the pending saves completed: write their manifests, then apply retention."""
        if not self._pending:
            return
        for step in self._pending:
            if self._step_dir(step).is_dir() and _primary():
                try:
                    write_manifest(self._step_dir(step))
                except OSError as e:       # the step stays unverified; retention keeps the last good one
                    print(f"[checkpoint] step {step}: could not write its checksum manifest ({_one_line(e)}); "
                          f"it is not counted as verified", flush=True)
        _barrier(f"specjax-ckpt-manifest-{self._pending[-1]}")
        for step in self._pending:         # every process: the manifest process 0 wrote
            if (self._step_dir(step) / MANIFEST).is_file():
                self._good.add(step)
        self._pending = []
        self._prune()

    def _prune(self) -> None:
        steps = self.steps()
        good = [s for s in steps if s in self._good]
        if not good or len(steps) <= self.keep:
            return
        anchor = good[-1]                  # the newest step verified good: kept, as is all after it
        for s in steps[:-self.keep]:
            if s < anchor:
                self.manager.delete(s)
                self._good.discard(s)

    def save(self, step: int, state, meta: dict | None = None, *, force: bool = False) -> bool:
        """Save `step` (asynchronously when so made). A failed earlier save, or this one, raises
        here: an OS failure (full disk, file size limit, read-only file system) as an `OSError`
        naming the file; the step's temporary directory is never taken for a finished step."""
        with _os_errors(self.directory):
            self.manager.wait_until_finished()     # (Orbax's save waits for the previous save anyway)
        self._settle()
        with _os_errors(self._step_dir(step)):
            saved = self.manager.save(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta or {}))), force=force)
        if saved:
            self._pending.append(int(step))
        return saved

    def restore(self, step: int, template) -> tuple[Any, dict]:
        """Orbax's restore of one step, unverified (see `restore_latest`)."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        out = self.manager.restore(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"] or {})

    def _mismatch(self, step: int, template) -> str | None:
        """A difference between the saved arrays' shapes/dtypes and the template's, read from the
        step's metadata only. Orbax's restore of a mismatched step fails inside its async reader
        and leaves coroutines that later print "Event loop is closed" tracebacks; this avoids it."""
        leaves = [x for x in jax.tree.leaves(template)]
        if any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) for x in leaves):
            return None                    # (typed PRNG keys: stored differently; let Orbax judge)
        try:
            meta = ocp.StandardCheckpointHandler().metadata(self._step_dir(step) / "state")
            saved = jax.tree.leaves(getattr(meta, "tree", meta), is_leaf=lambda a: hasattr(a, "shape"))
            got = sorted((tuple(a.shape), str(np.dtype(a.dtype))) for a in saved)
        except Exception:  # noqa: BLE001 - unreadable metadata: the restore itself will tell
            return None
        want = sorted((tuple(np.shape(x)), str(np.dtype(x.dtype))) for x in leaves)
        if got == want:
            return None
        extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        return (f"saved state does not match the template ({len(got)} arrays saved, {len(want)} expected; "
                f"saved only: {extra[:3]}, expected only: {missing[:3]})")

    def _restore_checked(self, step: int, template) -> tuple[Any, dict, bool]:
        verified = verify_manifest(self._step_dir(step))
        mismatch = self._mismatch(step, template)
        if mismatch is not None:           # not damage: keep the step, whatever its manifest
            raise _Transient(f"files intact but restore failed: {mismatch}" if verified else mismatch)
        try:
            state, meta = self.restore(step, template)
        except OSError as e:
            raise _Transient(f"read error: {_one_line(e)}") from None
        except Exception as e:  # noqa: BLE001
            if verified:       # the bytes are as saved: not corruption; keep the step
                raise _Transient(f"files intact but restore failed: {_one_line(e)}") from None
            raise CorruptCheckpoint(_one_line(e)) from None
        bad = _nonfinite_leaf(state)
        if bad is not None:
            raise CorruptCheckpoint(f"restored state is not finite at {bad}")
        return state, meta, verified

    def _keep_aside(self, step: int) -> pathlib.Path:
        dest_root = self.directory.parent / f"{self.directory.name}.kept"
        dest_root.mkdir(parents=True, exist_ok=True)
        dest, n = dest_root / str(step), 1
        while dest.exists():
            dest, n = dest_root / f"{step}.{n}", n + 1
        shutil.move(str(self._step_dir(step)), str(dest))
        return dest

    def restore_latest(self, template) -> Restored | None:
        """The newest checkpoint that verifies and restores, or None when there is none at all.

        Raises if checkpoints exist but none can be restored (a run must not silently restart
        from scratch over a directory of broken checkpoints); then nothing is deleted or moved.
        """
        self.manager.wait_until_finished()
        skipped, corrupt, transient = [], [], []
        steps = self.steps()

        def report(step, msg):
            print(f"[checkpoint] step {step} unreadable ({msg}); trying the previous one", flush=True)
            skipped.append((step, msg))

        for step in reversed(steps):
            try:
                try:
                    state, meta, verified = self._restore_checked(step, template)
                except _Transient as first:           # an I/O error: read it once more
                    state, meta, verified = self._restore_checked(step, template)
                    print(f"[checkpoint] step {step}: {first}; read again, restored", flush=True)
            except CorruptCheckpoint as e:
                report(step, f"corrupt: {e}")
                corrupt.append(step)
                continue
            except _Transient as e:
                report(step, f"{e}; kept")
                transient.append(step)
                continue
            kept = []
            # Every process has decided (from the same shared files) before any step is deleted or moved.
            _barrier(f"specjax-ckpt-decided-{step}")
            for s in corrupt:       # a resumed run saves these steps again, and Orbax refuses an existing step
                self.manager.delete(s)
            for s in transient:     # possibly intact: moved out of the way, never deleted
                dest = self._keep_aside(s) if _primary() else f"{self.directory.name}.kept/{s} (moved by process 0)"
                print(f"[checkpoint] step {s} kept at {dest} (not deleted; restore it by moving it back)",
                      flush=True)
                kept.append((s, str(dest)))
            if transient:
                _barrier(f"specjax-ckpt-kept-{step}")
            skipped = [(s, m + (f" at {dict(kept)[s]}" if s in dict(kept) else "")) for s, m in skipped]
            self.manager.reload()
            if verified:
                self._good.add(step)
            else:
                print(f"[checkpoint] step {step} has no checksum manifest (saved by an older version, or "
                      f"the process stopped before it was written); restored unverified, state finite",
                      flush=True)
            return Restored(step, state, meta, skipped, kept)
        if steps:
            raise RuntimeError(f"no readable checkpoint in {self.directory}: {skipped}")
        return None

    def wait(self) -> None:
        with _os_errors(self.directory):
            self.manager.wait_until_finished()
        self._settle()

    def close(self) -> None:
        with _os_errors(self.directory):
            self.manager.wait_until_finished()
        self._settle()
        self.manager.close()
