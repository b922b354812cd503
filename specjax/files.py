"""Files on disk: the checks of a path a command will write (before anything runs), one streaming sha256 for every place that checks bytes (cached model files,
checkpoint manifests, stored drafts and heads), the recovery of an append-only JSONL log after a
crash mid-write, and the exclusive lock a long job takes on its working directory."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import pathlib
import socket
import sys

LOCK_NAME = ".specjax.lock"


def path_problem(p: os.PathLike, want_dir: bool | None = None) -> str | None:
    """What stops a run from creating or writing path ``p``, from ``os.stat`` (which follows
    links): a symlink loop, a component that is a file, and with ``want_dir`` True / False an
    existing entry of the other kind; None when nothing does (absent paths included)."""
    import errno
    import stat
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"{p} is a symlink loop ({e.strerror})"
        if e.errno == errno.ENOTDIR:
            return f"{p}: a part of the path is a file, not a directory"
        return f"{p}: {e.strerror}"
    if want_dir is True and not stat.S_ISDIR(st.st_mode):
        return f"{p} is a file, not a directory"
    if want_dir is False and stat.S_ISDIR(st.st_mode):
        return f"{p} is a directory, not a file"
    return None


def check_output_file(setting: str, path: str) -> None:
    """A file a command will write at its end (``metrics_jsonl``) can be: its directory exists
    and is writable and the path is not a directory. Checked before the model loads, so a typo
    fails at once, not after the whole run; a ValueError naming the setting. "" is off."""
    if not path:
        return
    p = pathlib.Path(path).expanduser()
    parent = p.parent
    unusable = path_problem(p)          # a symlink loop, a file on the way
    if unusable:
        problem = unusable
    elif p.is_dir():
        problem = f"{p} is a directory"
    elif not parent.is_dir():
        problem = f"its directory {parent} does not exist" if not parent.exists() else f"{parent} is not a directory"
    elif not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        problem = f"{p if p.exists() else parent} is not writable"
    else:
        return
    raise ValueError(f"{setting}={path!r}: {problem}; nothing was run")


def _nearest_existing(p):
    """`p` or its nearest ancestor that exists (the directory a mkdir of `p` would write into)."""
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def dir_problem(path: str) -> str | None:
    """What stops a command from creating (if absent) and writing into the directory `path`:
    a symlink loop, a file on the way, or a nearest existing directory that is not writable
    (a read-only file system, no permission); None when nothing does."""
    p = pathlib.Path(path).expanduser()
    problem = path_problem(p)
    if problem is None:
        base = _nearest_existing(p)
        if not base.is_dir():
            problem = f"{base} is a file, not a directory"
        elif not os.access(base, os.W_OK | os.X_OK):
            problem = f"{base} is not writable (read-only file system or no permission)"
    return problem


def check_output_dir(setting: str, path: str) -> None:
    """A directory a command creates and writes into (``bench --config.out``), checked before
    anything loads (`dir_problem`): ValueError naming the setting."""
    if not str(path).strip():
        raise ValueError(f"{setting}={path!r}: empty; name the directory to write into")
    problem = dir_problem(path)
    if problem:
        raise ValueError(f"{setting}={path!r}: {problem}; nothing was run")


class WorkdirBusy(RuntimeError):
    """Another live process holds the working directory's lock."""


@contextlib.contextmanager
def workdir_lock(directory: os.PathLike, job: str):
    """Hold an exclusive OS lock (``flock``) on ``<directory>/.specjax.lock`` while the block runs.

    The lock belongs to the open file, so a process that dies (even by ``kill -9``) releases it:
    the file left behind is never stale, it only says who held it last. A second job on the same
    directory gets `WorkdirBusy` naming the holder (pid, host, command, start time) before it
    touches anything. On a file system without locks (NFS without lockd) the job runs unlocked
    after one warning on stderr. ``job`` names this job in the file (e.g. "specjax data").
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    f = open(path, "a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise WorkdirBusy(f"{directory} is in use by {holder}; wait for it to finish or choose another "
                              f"--workdir (two jobs in one directory overwrite each other's files)") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            # a file system without locks (NFS without lockd, some FUSE mounts): run unlocked, said once
            print(f"[specjax] warning: cannot lock {path} ({e.strerror}); running without the workdir lock: "
                  f"do not start a second job on {directory}", file=sys.stderr)
        f.seek(0)
        f.truncate()
        f.write(f"{job} (pid {os.getpid()} on {socket.gethostname()}, started "
                f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}: "
                f"{' '.join(sys.argv)[:300]})\n")
        f.flush()
        yield path
    finally:
        f.close()           # releases the lock


def file_sha256(path: os.PathLike) -> str:
    """sha256 hex digest of a file, read in 4 MiB blocks (memory independent of its size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def recover_jsonl(path: os.PathLike) -> tuple[int, pathlib.Path | None]:
    """Make an append-only JSONL log whole again after a crash mid-write: the complete records
    (lines ending in a newline that parse as JSON) up to the first one that does not are kept;
    from there on the file's bytes are moved to ``<path>.torn-<k>`` (k: the first free number)
    and the log is cut there. Returns (records kept, the set-aside file or None); a missing
    file is (0, None). Nothing is deleted."""
    path = pathlib.Path(path)
    if not path.is_file():
        return 0, None
    data = path.read_bytes()
    good_end, kept = 0, 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            json.loads(line)
        except ValueError:          # JSONDecodeError and UnicodeDecodeError
            break
        good_end += len(line)
        kept += 1
    if good_end == len(data):
        return kept, None
    k = 0
    while path.with_name(f"{path.name}.torn-{k}").exists():
        k += 1
    aside = path.with_name(f"{path.name}.torn-{k}")
    aside.write_bytes(data[good_end:])
    with open(path, "r+b") as f:
        f.truncate(good_end)
    return kept, aside
