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
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pathlib
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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def decode_shard(data: bytes, sources: Sequence[str], name: str = "shard") -> Sequences:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            toks, offsets, packed = z["tokens"], z["offsets"], z["loss_mask"]
            source, request = z["source"], z["request"]
    except Exception as e:   # zip, npy or key errors: one message naming the file
        raise ValueError(f"{name}: not a readable shard ({type(e).__name__}: {e})") from None
    if offsets[0] != 0 or offsets[-1] != len(toks) or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{name}: offsets do not cover the tokens")
    mask = np.unpackbits(packed, bitorder="little", count=len(toks)).astype(bool)
    cuts = list(zip(offsets[:-1], offsets[1:]))
    return Sequences(tokens=[toks[a:b].astype(np.int32) for a, b in cuts], loss_masks=[mask[a:b] for a, b in cuts],
                     sources=[sources[int(s)] for s in source], requests=[int(r) for r in request])


class ShardDir:
    """One stage's shard directory (see the module docstring): opened with the stage's
    ``settings`` (a JSON-able dict); `done` says which shards exist, `write` adds one."""

    def __init__(self, directory, settings: dict, *, vocab_size: int, sources: Sequence[str], log=None):
        self.dir = pathlib.Path(directory)
        self.vocab_size, self.sources = int(vocab_size), list(sources)
        self.settings = json.loads(json.dumps(settings))
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / MANIFEST
        if path.is_file():
            try:
                m = json.loads(path.read_text())
                if m.get("format") != FORMAT:
                    raise ValueError(f"format {m.get('format')!r}, expected {FORMAT!r}")
            except (ValueError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: not a shard manifest ({e})") from None
            if m["settings"] != self.settings or m["sources"] != self.sources or m["vocab_size"] != self.vocab_size:
                diff = sorted(k for k in set(m["settings"]) | set(self.settings)
                              if m["settings"].get(k) != self.settings.get(k))
                raise ValueError(f"{path} was written with other settings (differing: {diff or 'sources/vocab'}); "
                                 f"use another directory, or delete it to start over")
            self.manifest = m
        else:
            self.manifest = {"format": FORMAT, "settings": self.settings, "sources": self.sources,
                             "vocab_size": self.vocab_size, "shards": {}}
        listed = set(self.manifest["shards"])
        for p in sorted(self.dir.iterdir()):
            if p.name.endswith(".tmp"):
                p.unlink()
            elif p.name.startswith("shard-") and p.suffix == ".npz" and p.name not in listed:
                p.rename(p.with_name(p.name + ".unlisted"))
                if log:
                    log(f"{p}: not in the manifest (a run stopped while writing it): set aside as {p.name}.unlisted")
        for name, entry in self.manifest["shards"].items():
            self._check(name, entry)

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
        e = self.manifest["shards"].values()
        return {k: int(sum(x[k] for x in e)) for k in ("sequences", "tokens", "loss_tokens", "bytes")} | {
            "shards": len(self.manifest["shards"])}

    def read(self, k: int) -> Sequences:
        name = shard_name(k)
        return decode_shard(self._check(name, self.manifest["shards"][name]), self.sources, str(self.dir / name))


def read_manifest(directory) -> dict:
    """A shard directory's manifest (FileNotFoundError when there is none, ValueError naming the
    file when it does not parse or is another format)."""
    path = pathlib.Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no shard manifest (run the data command into {path.parent.parent} first)")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a shard manifest ({e})") from None
    if m.get("format") != FORMAT:
        raise ValueError(f"{path}: format {m.get('format')!r}, expected {FORMAT!r}")
    return m


def read_listed(directory, manifest: dict, name: str) -> Sequences:
    """One shard a manifest lists, checked against its sha256 (ValueError naming the file)."""
    p = pathlib.Path(directory) / name
    data = p.read_bytes() if p.is_file() else None
    if data is None or _sha256(data) != manifest["shards"][name]["sha256"]:
        raise ValueError(f"{p}: missing or its sha256 differs from the manifest's (a damaged shard): delete it "
                         f"and its manifest entry to make it again")
    return decode_shard(data, manifest["sources"], str(p))


def read_dir(directory) -> Iterator[Sequences]:
    """Every shard of a directory, in shard order, each checked against the manifest's sha256."""
    m = read_manifest(directory)
    for name in m["shards"]:
        yield read_listed(directory, m, name)
