"""File digests: one streaming sha256 for every place that checks bytes on disk (cached model
files, checkpoint manifests, stored drafts and heads)."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: os.PathLike) -> str:
    """sha256 hex digest of a file, read in 4 MiB blocks (memory independent of its size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
