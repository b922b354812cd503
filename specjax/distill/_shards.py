"""Generated sequences as compact, checksummed shards with a manifest (format ``specjax-shards-1``).

A stage of the data engine writes its output into one directory::

    manifest.json        format, the stage's settings, and per shard: file, sha256, counts
    shard-00000.npz      compressed arrays of one shard (below)

A shard holds ``n`` sequences: ``tokens`` (uint16 when the vocabulary fits, else uint32),
concatenated, with ``offsets`` [n + 1] (int64); ``loss_mask``, one bit per token
(`np.packbits`, little bit order), set on the tokens a loss is taken on (the target's own
tokens); ``source`` [n] (int16, an index into the manifest's ``sources``) and ``request`` [n]
(int64, the request's id in its stage, which also keys its sampling).

Resume. Shard k covers a fixed range of the stage's requests, so a run that stops can be
started again and regenerates exactly the missing shards. A shard counts only once it is in
the manifest: it is written to a temporary file, flushed, renamed into place, and then the
manifest is replaced (also through a temporary file); a shard file the manifest does not list
(a run killed between the two) is set aside as ``*.unlisted`` and made again, and every listed
shard's sha256 is checked when the directory is opened and when it is read. A manifest written
with other settings is refused, naming the settings that differ.

Checked input. A manifest is validated when it is opened (its ``format``, ``settings`` object,
``sources`` list, ``vocab_size`` and ``shards`` object; per entry its ``sha256`` and counts);
listed names must be plain shard file names (``shard-NNNNN.npz``) inside the directory, so a
hand-edited ``../outside.npz`` is never read; a shard's arrays must agree with each other, its
``source`` indices with the manifest's ``sources`` and its token ids with ``vocab_size``. Each
problem is one ValueError naming the file and the key or value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pathlib
import re
from typing import Iterator, Sequence

import numpy as np

FORMAT = "specjax-shards-1"
MANIFEST = "manifest.json"


@dataclasses.dataclass
class Sequences:
    """Ragged sequences of one shard (host numpy)."""
    tokens: list[np.ndarray]
    loss_masks: list[np.ndarray]
    sources: list[str]
    requests: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(t) for t in self.tokens))

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(int(m.sum()) for m in self.loss_masks))


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.npz"


SHARD_NAME = re.compile(r"shard-[0-9]{5,}\.npz")
COUNTS = ("sequences", "tokens", "loss_tokens", "bytes")


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def validate_manifest(m, path) -> dict:
    """`m` (a parsed manifest.json at `path`) if it has the format's keys and types, else one
    ValueError naming the file and the key or value (see the module docstring)."""
    if not isinstance(m, dict):
        raise ValueError(f"{path}: not a shard manifest (a JSON {type(m).__name__}, expected an object)")
    if m.get("format") != FORMAT:
        raise ValueError(f"{path}: not a shard manifest (format {m.get('format')!r}, expected {FORMAT!r})")
    for key, kind, what in (("settings", dict, "an object"), ("sources", list, "a list of names"),
                            ("shards", dict, "an object {file name: entry}")):
        if key not in m:
            raise ValueError(f"{path}: no {key!r} (a shard manifest holds format, settings, sources, vocab_size "
                             f"and shards)")
        if not isinstance(m[key], kind):
            raise ValueError(f"{path}: {key!r} is a JSON {type(m[key]).__name__}, expected {what}")
    if not m["sources"] or not all(isinstance(x, str) for x in m["sources"]):
        raise ValueError(f"{path}: 'sources' = {m['sources']!r}: expected a non-empty list of names")
    v = m.get("vocab_size")
    if not _is_count(v) or v < 1:
        raise ValueError(f"{path}: 'vocab_size' = {v!r}: expected an integer >= 1")
    for name, entry in m["shards"].items():
        if not SHARD_NAME.fullmatch(name):
            raise ValueError(f"{path}: lists {name!r}, not a shard file name of this directory (expected "
                             f"shard-NNNNN.npz; a path is never followed out of {pathlib.Path(path).parent})")
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: the entry of {name} is a JSON {type(entry).__name__}, expected an object")
        sha = entry.get("sha256")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise ValueError(f"{path}: the entry of {name} has " + ("no 'sha256'" if sha is None else
                                                                   f"'sha256' = {sha!r}") +
                             " (expected the shard file's sha256, 64 hex digits)")
        for k in COUNTS:
            if not _is_count(entry.get(k)):
                raise ValueError(f"{path}: the entry of {name} has {k!r} = {entry.get(k)!r}: expected an "
                                 f"integer >= 0")
        dropped = entry.get("dropped", {})
        if not isinstance(dropped, dict) or not all(isinstance(k, str) and _is_count(n) for k, n in dropped.items()):
            raise ValueError(f"{path}: the entry of {name} has 'dropped' = {dropped!r}: expected "
                             f"{{status: count}}")
    return m


def _load_manifest(path: pathlib.Path) -> dict:
    try:
        m = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a shard manifest ({e})") from None
    return validate_manifest(m, path)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is None and e.errno is not None:      # a short write (ENOSPC, EFBIG) names no file
            raise OSError(e.errno, e.strerror, str(tmp)) from e
        raise


def encode_shard(seqs: Sequences, vocab_size: int, sources: Sequence[str]) -> bytes:
    """The .npz bytes of one shard (see the module docstring)."""
    n = len(seqs)
    if not (len(seqs.loss_masks) == len(seqs.sources) == len(seqs.requests) == n):
        raise ValueError("a shard needs one loss mask, source and request per sequence")
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    toks = np.concatenate([np.asarray(t, np.int64) for t in seqs.tokens]) if n else np.zeros(0, np.int64)
    if toks.size and (toks.min() < 0 or toks.max() >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size}) in a shard")
    for t, m in zip(seqs.tokens, seqs.loss_masks):
        if len(t) != len(m):
            raise ValueError(f"a loss mask of {len(m)} entries for {len(t)} tokens")
    mask = np.concatenate([np.asarray(m, bool) for m in seqs.loss_masks]) if n else np.zeros(0, bool)
    source_ids = [list(sources).index(s) for s in seqs.sources]
    buf = io.BytesIO()
    np.savez_compressed(buf, tokens=toks.astype(dtype),
                        offsets=np.cumsum([0] + [len(t) for t in seqs.tokens]).astype(np.int64),
                        loss_mask=np.packbits(mask, bitorder="little"),
                        source=np.asarray(source_ids, np.int16), request=np.asarray(seqs.requests, np.int64))
    return buf.getvalue()


def decode_shard(data: bytes, sources: Sequence[str], name: str = "shard", vocab_size: int | None = None) -> Sequences:
    """The sequences of one shard's bytes, checked: its arrays agree with each other, its source
    indices lie in ``sources`` and (given ``vocab_size``) its token ids below it (ValueError
    naming ``name`` otherwise)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            toks, offsets, packed = z["tokens"], z["offsets"], z["loss_mask"]
            source, request = z["source"], z["request"]
    except Exception as e:   # zip, npy or key errors: one message naming the file
        raise ValueError(f"{name}: not a readable shard ({type(e).__name__}: {e})") from None
    if (toks.ndim != 1 or offsets.ndim != 1 or len(offsets) < 1 or packed.dtype != np.uint8
            or not all(np.issubdtype(a.dtype, np.integer) for a in (toks, offsets, source, request))):
        raise ValueError(f"{name}: not a readable shard (arrays tokens {toks.dtype}{list(toks.shape)}, offsets "
                         f"{offsets.dtype}{list(offsets.shape)}, loss_mask {packed.dtype}, source {source.dtype}, "
                         f"request {request.dtype})")
    if offsets[0] != 0 or offsets[-1] != len(toks) or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{name}: offsets do not cover the tokens")
    n = len(offsets) - 1
    if source.shape != (n,) or request.shape != (n,) or packed.size * 8 < len(toks):
        raise ValueError(f"{name}: {n} sequences but {source.size} sources, {request.size} requests and a loss "
                         f"mask of {packed.size * 8} bits for {len(toks)} tokens")
    if n and (source.min() < 0 or source.max() >= len(sources)):
        bad = int(source.min()) if source.min() < 0 else int(source.max())
        raise ValueError(f"{name}: source index {bad} outside the manifest's {len(sources)} sources {list(sources)}")
    if len(toks) and (toks.min() < 0 or (vocab_size is not None and toks.max() >= vocab_size)):
        bad = int(toks.min()) if toks.min() < 0 else int(toks.max())
        raise ValueError(f"{name}: token id {bad} outside the vocabulary [0, {vocab_size}) of its manifest "
                         f"(a hand-edited manifest or shard?)")
    mask = np.unpackbits(packed, bitorder="little", count=len(toks)).astype(bool)
    cuts = list(zip(offsets[:-1], offsets[1:]))
    return Sequences(tokens=[toks[a:b].astype(np.int32) for a, b in cuts], loss_masks=[mask[a:b] for a, b in cuts],
                     sources=[sources[int(s)] for s in source], requests=[int(r) for r in request])


class ShardDir:
    """One stage's shard directory (see the module docstring): opened with the stage's
    ``settings`` (a JSON-able dict); `done` says which shards exist, `write` adds one."""

    def __init__(self, directory, settings: dict, *, vocab_size: int, sources: Sequence[str], log=None,
                 recorded_later: Sequence[str] = (), describe: dict | None = None):
        """``recorded_later``: settings keys that manifests written before they were recorded
        lack; such a manifest, equal in every other setting, is adopted and the keys added (with
        a log line). ``describe``: {key: (what it is, what to do)} for a differing key, to name
        both values in the refusal (e.g. the target's weight digest)."""
        self.dir = pathlib.Path(directory)
        self.vocab_size, self.sources = int(vocab_size), list(sources)
        self.settings = json.loads(json.dumps(settings))
        path = self.dir / MANIFEST
        if path.is_file():
            m = _load_manifest(path)
            missing = [k for k in recorded_later if k in self.settings and k not in m["settings"]]
            old = dict(m["settings"], **{k: self.settings[k] for k in missing})
            if old != self.settings or m["sources"] != self.sources or m["vocab_size"] != self.vocab_size:
                diff = sorted(k for k in set(old) | set(self.settings) if old.get(k) != self.settings.get(k))
                for k in diff:
                    if k in (describe or {}):
                        what, todo = describe[k]
                        raise ValueError(f"{path}: its shards were made with {what} {old.get(k)!r}, this run has "
                                         f"{self.settings.get(k)!r}; {todo}")
                if not diff:
                    diff = [f"sources {m['sources']} != {self.sources}"] if m["sources"] != self.sources else []
                    if m["vocab_size"] != self.vocab_size:
                        diff.append(f"vocab_size {m['vocab_size']} != {self.vocab_size}")
                raise ValueError(f"{path} was written with other settings (differing: {diff}); "
                                 f"use another directory, or delete it to start over")
            self.manifest = m
        else:
            missing = []
            self.dir.mkdir(parents=True, exist_ok=True)
            self.manifest = {"format": FORMAT, "settings": self.settings, "sources": self.sources,
                             "vocab_size": self.vocab_size, "shards": {}}
        for name, entry in self.manifest["shards"].items():     # refused here: nothing in the directory changed
            self._check(name, entry)
        listed = set(self.manifest["shards"])
        for p in sorted(self.dir.iterdir()):
            if p.name.endswith(".tmp"):
                p.unlink()
            elif p.name.startswith("shard-") and p.suffix == ".npz" and p.name not in listed:
                p.rename(p.with_name(p.name + ".unlisted"))
                if log:
                    log(f"{p}: not in the manifest (a run stopped while writing it): set aside as {p.name}.unlisted")
        if missing:
            self.manifest["settings"] = self.settings
            _atomic_write(path, (json.dumps(self.manifest, indent=1) + "\n").encode())
            if log:
                log(f"{path}: written before {missing} were recorded; recorded them now for its "
                    f"{len(self.manifest['shards'])} shards")

    def _check(self, name: str, entry: dict) -> bytes:
        p = self.dir / name
        if not p.is_file():
            raise ValueError(f"{p}: listed in {self.dir / MANIFEST} but missing; delete the directory to start over")
        data = p.read_bytes()
        if _sha256(data) != entry["sha256"]:
            raise ValueError(f"{p}: sha256 {_sha256(data)[:12]}... differs from the manifest's "
                             f"{entry['sha256'][:12]}... (a damaged shard): delete it and its manifest entry, "
                             f"or the directory, to make it again")
        return data

    def done(self, k: int) -> bool:
        return shard_name(k) in self.manifest["shards"]

    def write(self, k: int, seqs: Sequences, **info) -> dict:
        name = shard_name(k)
        data = encode_shard(seqs, self.vocab_size, self.sources)
        _atomic_write(self.dir / name, data)
        entry = {"sha256": _sha256(data), "sequences": len(seqs), "tokens": seqs.num_tokens,
                 "loss_tokens": seqs.num_loss_tokens, "bytes": len(data), **info}
        self.manifest["shards"][name] = entry
        self.manifest["shards"] = dict(sorted(self.manifest["shards"].items()))
        _atomic_write(self.dir / MANIFEST, (json.dumps(self.manifest, indent=1) + "\n").encode())
        return entry

    def totals(self) -> dict:
        """Counts over the listed shards, with ``dropped``: {status: requests} of the requests
        left out for not finishing normally (see `_datagen`)."""
        return totals(self.manifest)

    def read(self, k: int) -> Sequences:
        name = shard_name(k)
        return decode_shard(self._check(name, self.manifest["shards"][name]), self.sources, str(self.dir / name),
                            vocab_size=self.vocab_size)


def totals(manifest: dict) -> dict:
    """A (validated) manifest's counts summed over its shards, ``shards`` and ``dropped``
    ({status: requests left out}, summed over the entries that record it)."""
    e = manifest["shards"].values()
    dropped: dict[str, int] = {}
    for x in e:
        for k, n in x.get("dropped", {}).items():
            dropped[k] = dropped.get(k, 0) + int(n)
    return {k: int(sum(x[k] for x in e)) for k in COUNTS} | {"shards": len(manifest["shards"]),
                                                           "dropped": dict(sorted(dropped.items()))}


def read_manifest(directory) -> dict:
    """A shard directory's manifest (FileNotFoundError when there is none, ValueError naming the
    file when it does not parse or is another format)."""
    path = pathlib.Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no shard manifest (run the data command into {path.parent.parent} first)")
    return _load_manifest(path)


def read_listed(directory, manifest: dict, name: str) -> Sequences:
    """One shard a (validated, `read_manifest`) manifest lists, checked against its sha256 and
    its token ids against the manifest's vocabulary (ValueError naming the file)."""
    if not SHARD_NAME.fullmatch(name):          # never a path out of the directory
        raise ValueError(f"{pathlib.Path(directory) / MANIFEST}: lists {name!r}, not a shard file name of this "
                         f"directory (expected shard-NNNNN.npz)")
    p = pathlib.Path(directory) / name
    data = p.read_bytes() if p.is_file() else None
    if data is None or _sha256(data) != manifest["shards"][name]["sha256"]:
        raise ValueError(f"{p}: missing or its sha256 differs from the manifest's (a damaged shard): delete it "
                         f"and its manifest entry to make it again")
    return decode_shard(data, manifest["sources"], str(p), vocab_size=int(manifest["vocab_size"]))


def read_dir(directory) -> Iterator[Sequences]:
    """Every shard of a directory, in shard order, each checked against the manifest's sha256."""
    m = read_manifest(directory)
    for name in m["shards"]:
        yield read_listed(directory, m, name)
