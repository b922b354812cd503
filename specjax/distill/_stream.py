"""Training batches streamed from the data engine's shards (`specjax data`), memory bounded.

`ShardStream` reads one or more shard directories (``specjax-shards-1``, `_shards`) and emits the
same batches a `BatchPlan` emits (``tokens`` [B, W] int32, ``mask`` [B, W] float32: position t
predicts token t + 1, and counts where token t + 1 carries the shard's loss bit, i.e. it is one
of the target's own answer tokens), without holding the corpus:

* **Index.** Opening the stream reads every listed shard once (each checked against its
  manifest's sha256) and keeps three integers per sequence: its length, the position of its
  first loss token and its loss tokens inside the widest width. Tokens are not kept.
* **Order.** A canonical order interleaves the directories shard by shard (shard 0 of each, then
  shard 1 of each, ...); ``max_loss_tokens`` keeps the first sequences of that order, so smaller
  data sizes are prefixes of larger ones (a learning curve's points are nested).
* **Shuffle.** Epoch e permutes the shards by ``default_rng([seed, e])`` and cuts them into
  groups of ``window`` shards; the sequences of group g are permuted by
  ``default_rng([seed, e, g])`` and sorted into the narrowest width bucket that holds them (cut
  at the widest), a bucket emitting a batch at ``tokens_per_batch // width`` rows and the partly
  filled buckets emitted padded at the group's end. A batch therefore reads only its group's
  shards: at most ``window`` decoded shards are held at a time, whatever the corpus size.
* **Resume.** Batch i is a pure function of (the shards, seed, i): a run resumed at step i
  continues mid-epoch with the batches an uninterrupted run would have seen. `fingerprint`
  names the shards a stream reads (their sha256s and the cut), so a resumed run can refuse a
  corpus that changed under it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import pathlib
from typing import Sequence

import numpy as np

from specjax.distill import _data, _shards

DEFAULT_WINDOW = 8


class ShardStream:
    """A deterministic, endless stream of fixed-shape batches over shard directories (see the
    module docstring). The interface the trainer reads is `BatchPlan`'s: `batch`,
    `loss_tokens_used`, `mean_tokens_per_batch`, `batches_per_epoch`, plus `token_counts`."""

    def __init__(self, directories: Sequence, *, seed: int, tokens_per_batch: int = 4096,
                 widths: Sequence[int] = (256, 512, 1024), window: int = DEFAULT_WINDOW, max_prompt: int = 0,
                 max_loss_tokens: int = 0):
        if not directories:
            raise ValueError("a shard stream needs at least one shard directory")
        if window < 1:
            raise ValueError(f"window={window}: the number of shards shuffled together must be >= 1")
        if tokens_per_batch < 1 or not widths or min(widths) < 2:
            raise ValueError(f"tokens_per_batch={tokens_per_batch}, widths={tuple(widths)}: need >= 1 tokens per "
                             f"batch and widths >= 2")
        self.dirs = [pathlib.Path(d) for d in directories]
        self.seed, self.tokens_per_batch = int(seed), int(tokens_per_batch)
        self.widths = tuple(sorted(int(w) for w in widths))
        self.window, self.max_prompt, self.max_loss_tokens = int(window), int(max_prompt), int(max_loss_tokens)
        manifests = [_shards.read_manifest(d) for d in self.dirs]
        # canonical order: shard 0 of every directory, then shard 1, ...
        names = [sorted(m["shards"]) for m in manifests]
        self.shards: list[tuple[int, str]] = [(di, names[di][k]) for k in range(max(map(len, names), default=0))
                                              for di in range(len(self.dirs)) if k < len(names[di])]
        if not self.shards:
            raise ValueError(f"no shards in {', '.join(map(str, self.dirs))} (the data command has not "
                             f"finished a shard there yet)")
        self._manifests = manifests
        W = self.widths[-1]
        # Per shard: (lengths, first loss positions, loss tokens inside W) of the sequences used.
        self._index: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        total, full = 0, True
        for s, (di, name) in enumerate(self.shards):
            seqs = self._read(s)
            n = np.asarray([len(t) for t in seqs.tokens], np.int64)
            first = np.asarray([int(np.argmax(m)) if m.any() else len(m) for m in seqs.loss_masks], np.int64)
            loss = np.asarray([int(m[1:min(len(m), W)].sum()) for m in seqs.loss_masks], np.int64)
            used = (loss > 0) & ((first <= self.max_prompt) if self.max_prompt else True)
            loss = np.where(used, loss, 0)
            if self.max_loss_tokens:
                room = self.max_loss_tokens - total
                keep = np.cumsum(loss) - loss < room          # sequences that start below the cut
                loss = np.where(keep, loss, 0)
            total += int(loss.sum())
            self._index.append((n, first, loss))
            if self.max_loss_tokens and total >= self.max_loss_tokens:
                full = False
                self.shards = self.shards[:s + 1]
                break
        self.complete = full
        if total == 0:
            raise ValueError(f"no training data in {', '.join(map(str, self.dirs))}: no sequence has a loss token "
                             f"inside the widest width {W}" + (f" with a prompt of <= {self.max_prompt} tokens"
                                                              if self.max_prompt else ""))
        self._loss_total = total
        self._epochs: dict[int, list[tuple[int, list[tuple[int, int]]]]] = {}
        self._cache: collections.OrderedDict[int, _shards.Sequences] = collections.OrderedDict()

    # ----------------------------------------------------------------------------- reading
    def _read(self, s: int) -> _shards.Sequences:
        di, name = self.shards[s]
        return _shards.read_listed(self.dirs[di], self._manifests[di], name)

    def _shard(self, s: int) -> _shards.Sequences:
        if s in self._cache:
            self._cache.move_to_end(s)
            return self._cache[s]
        seqs = self._read(s)
        self._cache[s] = seqs
        while len(self._cache) > self.window:
            self._cache.popitem(last=False)
        return seqs

    # ----------------------------------------------------------------------------- the plan
    def fingerprint(self) -> str:
        """A hash of what the stream reads: each shard's sha256 in canonical order and the cut."""
        spec = [[str(self.dirs[di].name), name, self._manifests[di]["shards"][name]["sha256"]]
                for di, name in self.shards]
        return hashlib.sha256(json.dumps([spec, self.max_loss_tokens, self.max_prompt, self.widths[-1]]).encode()
                              ).hexdigest()[:16]

    def rows_for(self, width: int) -> int:
        return max(1, self.tokens_per_batch // width)

    def epoch(self, e: int) -> list[tuple[int, list[tuple[int, int]]]]:
        """Epoch e's batches as (width, [(shard, sequence), ...]) in training order."""
        if e not in self._epochs:
            if len(self._epochs) > 4:        # a resumed or long run walks forward: old epochs are not revisited
                self._epochs.pop(min(self._epochs))
            order = np.random.default_rng([self.seed, e]).permutation(len(self.shards))
            batches = []
            for g in range(0, len(order), self.window):
                group = [int(s) for s in order[g:g + self.window]]
                rows = [(s, j) for s in group for j in np.flatnonzero(self._index[s][2] > 0).tolist()]
                perm = np.random.default_rng([self.seed, e, g // self.window]).permutation(len(rows))
                picked = [rows[r] for r in perm]
                batches += _data.fill_buckets(picked, [self._index[s][0][j] for s, j in picked], self.widths,
                                              self.rows_for)
            self._epochs[e] = batches
        return self._epochs[e]

    @property
    def batches_per_epoch(self) -> int:
        return len(self.epoch(0))

    def locate(self, i: int) -> tuple[int, int]:
        """(epoch, batch within it) of batch i (epochs differ in length by their partly filled
        buckets)."""
        if i < 0:
            raise ValueError(f"batch index {i} < 0")
        return _data.locate_in_epochs(self.epoch, i)

    def batch(self, i: int) -> dict:
        e, j = self.locate(i)
        W, rows = self.epoch(e)[j]
        B = self.rows_for(W)
        tokens = np.zeros((B, W), np.int32)
        mask = np.zeros((B, W), np.float32)
        for r, (s, q) in enumerate(rows):
            seqs = self._shard(s)
            t, m = seqs.tokens[q][:W], seqs.loss_masks[q][:W]
            tokens[r, :len(t)] = t
            mask[r, :len(t) - 1] = m[1:]
        return {"tokens": tokens, "mask": mask}

    # ----------------------------------------------------------------------------- totals
    def loss_tokens_used(self) -> int:
        """Loss tokens of one pass over the stream (inside the widest width, after the cut)."""
        return self._loss_total

    def mean_tokens_per_batch(self) -> float:
        return self._loss_total / max(self.batches_per_epoch, 1)

    @property
    def num_sequences(self) -> int:
        return int(sum(int((ix[2] > 0).sum()) for ix in self._index))

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """Counts of each token id over the loss tokens the stream trains on (reads every shard)."""
        counts = np.zeros((vocab_size,), np.int64)
        W = self.widths[-1]
        for s in range(len(self.shards)):
            seqs = self._read(s)
            for q in np.flatnonzero(self._index[s][2] > 0):
                t, m = seqs.tokens[q][:W], seqs.loss_masks[q][:W]
                np.add.at(counts, t[1:][m[1:]], 1)
        return counts
