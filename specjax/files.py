"""Files on disk: one streaming sha256 for every place that checks bytes (cached model files,
checkpoint manifests, stored drafts and heads), and the recovery of an append-only JSONL log
after a crash mid-write."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib


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
