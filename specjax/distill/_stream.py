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
  ``group_by_length``: the group's sequences are first sorted by their loss tokens (a stable
  sort of the permuted order, so equal counts stay shuffled) and its batches then permuted by
  ``default_rng([seed, e, g, 1])``, so a batch's rows have answers of similar length: a head's
  step then runs its later drafting steps at few origins beyond its answers
  (`specjax.distill.loss_origins`, whose width is the batch's longest).
* **Resume.** Batch i is a pure function of (the shards, seed, i): a run resumed at step i
  continues mid-epoch with the batches an uninterrupted run would have seen. `fingerprint`
  names the shards a stream reads (their sha256s and the cut), so a resumed run can refuse a
  corpus that changed under it.
* **Features.** A head's training step otherwise runs the target over every batch. With
  `ShardFeatures` attached (`with_features`), batches also carry ``features`` [B, W, F] (the
  residual stream after the head's layers) and ``final_residual`` [B, W, D] (after the last
  layer; the step applies the target's final norm for the teacher), read from per-(shard,
  layer) files computed once: every later step, epoch, run and nested data size reuses them.
* **Vocabulary.** Every directory's manifest records the vocabulary of the target that wrote it
  (``vocab_size``) and every shard read is checked against it; the directories must agree, and
  the target trained against must have that vocabulary (``vocab_size=``, `check_vocab`; also
  checked by `token_counts` and by `ShardFeatures.compute` with `_data.shard_feature_forward`):
  shards of another target are refused naming both sizes, not trained on.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pathlib
import time
from typing import Callable, Sequence

import numpy as np

from specjax.distill import _data, _shards

DEFAULT_WINDOW = 8


class ShardStream:
    """A deterministic, endless stream of fixed-shape batches over shard directories (see the
    module docstring). The interface the trainer reads is `BatchPlan`'s: `batch`,
    `loss_tokens_used`, `mean_tokens_per_batch`, `batches_per_epoch`, plus `token_counts`."""

    def __init__(self, directories: Sequence, *, seed: int, tokens_per_batch: int = 4096,
                 widths: Sequence[int] = (256, 512, 1024), window: int = DEFAULT_WINDOW, max_prompt: int = 0,
                 max_loss_tokens: int = 0, vocab_size: int | None = None, group_by_length: bool = False):
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
        self.group_by_length = bool(group_by_length)
        manifests = [_shards.read_manifest(d) for d in self.dirs]
        sizes = {int(m["vocab_size"]) for m in manifests}
        if len(sizes) > 1:
            raise ValueError("shard directories of targets with different vocabularies: " + ", ".join(
                f"{d} ({m['vocab_size']})" for d, m in zip(self.dirs, manifests)) + "; stream shards of one target")
        self.vocab_size = sizes.pop()
        if vocab_size is not None:
            self.check_vocab(vocab_size)
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
        self.features: ShardFeatures | None = None

    def check_vocab(self, vocab_size: int, what: str = "the target") -> None:
        """Refuse (ValueError naming both sizes) shards written for a larger vocabulary than the
        target's (their token ids could index past its embedding). A smaller one is accepted:
        models that share a tokenizer pad their vocabularies differently (Qwen2.5 0.5B-3B:
        151,936; 7B and up: 152,064), and every token id read is checked against the shards'
        size, so each is below the target's."""
        if self.vocab_size > int(vocab_size):
            raise ValueError(f"{', '.join(str(d / _shards.MANIFEST) for d in self.dirs)}: shards written for a "
                             f"target with a vocabulary of {self.vocab_size} tokens, but {what} has "
                             f"{int(vocab_size)}; train on shards the data command made with this target")

    def with_features(self, features: "ShardFeatures") -> "ShardStream":
        """Emit the cached features of `features` (computed for every shard) with each batch."""
        features.check_complete()
        self.features = features
        return self

    def shard_sha256(self, s: int) -> str:
        di, name = self.shards[s]
        return self._manifests[di]["shards"][name]["sha256"]

    def positions(self, s: int) -> np.ndarray:
        """Positions of each sequence of shard s that a batch can read (its length cut at the
        widest width)."""
        return np.minimum(self._index[s][0], self.widths[-1])

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
        """A hash of what the stream reads: each shard's sha256 in canonical order and the cut (and
        the batching's grouping by length, when on)."""
        spec = [[str(self.dirs[di].name), name, self._manifests[di]["shards"][name]["sha256"]]
                for di, name in self.shards]
        what = [spec, self.max_loss_tokens, self.max_prompt, self.widths[-1]] + (
            ["group_by_length"] if self.group_by_length else [])
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]

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
                if self.group_by_length:
                    picked.sort(key=lambda sj: int(self._index[sj[0]][2][sj[1]]))
                filled = _data.fill_buckets(picked, [self._index[s][0][j] for s, j in picked], self.widths,
                                            self.rows_for)
                if self.group_by_length:
                    filled = [filled[i] for i in
                              np.random.default_rng([self.seed, e, g // self.window, 1]).permutation(len(filled))]
                batches += filled
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
        out = {"tokens": tokens, "mask": mask}
        if self.features is not None:
            out.update(self.features.batch(rows, B, W))
        return out

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
        self.check_vocab(vocab_size)
        counts = np.zeros((vocab_size,), np.int64)
        W = self.widths[-1]
        for s in range(len(self.shards)):
            seqs = self._read(s)
            for q in np.flatnonzero(self._index[s][2] > 0):
                t, m = seqs.tokens[q][:W], seqs.loss_masks[q][:W]
                np.add.at(counts, t[1:][m[1:]], 1)
        return counts


def _clock(seconds: float) -> str:
    """``h:mm`` of a duration (an estimate for a log line)."""
    m = int(round(seconds / 60))
    return f"{m // 60}:{m % 60:02d}"


class ShardFeatures:
    """The target's residual stream after each of ``layers`` (and after its last layer, the
    teacher's input) at every position of a `ShardStream`'s sequences, cut at its widest width:
    one ``.npy`` file per (shard, layer) under ``root / shard-features-<key>`` (the key names the
    target, its dtype, the storage dtype and the width), named by the shard's sha256, so nested
    data sizes, both head kinds and later runs share what is computed once. A file is written
    under a temporary name and renamed when complete: a killed run leaves no file to trust.

    `compute` makes the missing files (one target forward per shard for all its missing layers);
    `batch` assembles a batch's ``features`` (the head's layers, concatenated) and
    ``final_residual`` from memory maps."""

    def __init__(self, stream: ShardStream, root, *, key: dict, layers: Sequence[int], final_layer: int,
                 hidden_size: int, dtype: str = "float32"):
        if dtype not in _data.FEATURE_DTYPES:
            raise ValueError(f"feature cache dtype must be one of {_data.FEATURE_DTYPES}, got {dtype!r}")
        self.stream, self.dtype, self.hidden_size = stream, dtype, int(hidden_size)
        self.layers, self.final_layer = tuple(int(i) for i in layers), int(final_layer)
        self.dir = pathlib.Path(root) / f"shard-features-{_data.cache_key(**key, dtype=dtype, width=stream.widths[-1])}"
        self._offsets = [np.concatenate([[0], np.cumsum(stream.positions(s))]).astype(np.int64)
                         for s in range(len(stream.shards))]
        self._maps: dict[tuple[int, int], np.ndarray] = {}

    def path(self, s: int, layer: int) -> pathlib.Path:
        return self.dir / f"{self.stream.shard_sha256(s)[:24]}-L{layer}.npy"

    def missing(self, layers: Sequence[int] | None = None) -> dict[int, list[int]]:
        """{shard: [its layers without a complete file]} over `layers` (default: the head's and the last)."""
        want = sorted(set(self.layers) | {self.final_layer} if layers is None else {int(i) for i in layers})
        out = {}
        for s in range(len(self.stream.shards)):
            todo = [i for i in want if not self.path(s, i).is_file()]
            if todo:
                out[s] = todo
        return out

    def check_complete(self) -> None:
        """Every file of the head's layers and the last is there and holds its shard's positions
        (ValueError naming the first that does not; only the .npy headers are read)."""
        gaps = self.missing()
        if gaps:
            s, layers = next(iter(gaps.items()))
            raise ValueError(f"{self.path(s, layers[0])}: no cached features ({len(gaps)} shards incomplete); "
                             f"`ShardFeatures.compute` makes them")
        for s in range(len(self.stream.shards)):
            for i in sorted(set(self.layers) | {self.final_layer}):
                self._map(s, i)

    def compute(self, forward: Callable, params, *, layers: Sequence[int] | None = None, tokens_per_batch: int = 8192,
                log: Callable[[str], None] | None = None) -> int:
        """Make every missing file of `layers` (default: the head's and the last).
        ``forward(params, tokens_BW, layers) -> [B, W, len(layers) x D]`` is the target's trunk
        collecting those layers (`shard_feature_forward`, which also names the target's
        vocabulary, checked against the shards' first). Returns the positions computed."""
        if getattr(forward, "vocab_size", None) is not None:
            self.stream.check_vocab(forward.vocab_size)
        self.dir.mkdir(parents=True, exist_ok=True)
        done = 0
        gaps = self.missing(layers)
        total = sum(int(self._offsets[s][-1]) for s in gaps)
        if log and gaps:
            log(f"shard features: {len(gaps)} shards to compute, {total:,} positions")
        t0 = time.perf_counter()
        for n, (s, todo) in enumerate(gaps.items()):
            D, P = self.hidden_size, int(self._offsets[s][-1])
            # a name of this process's own: two processes filling one cache never share a file
            tmps = {i: self.path(s, i).with_name(f"{self.path(s, i).stem}.partial-{os.getpid()}.npy") for i in todo}
            if P == 0:                    # no positions (an empty shard): empty files, no forward
                for i in todo:
                    np.save(tmps[i], np.zeros((0, D), np.dtype(self.dtype)))
                    tmps[i].replace(self.path(s, i))
                continue
            try:
                self._compute_shard(s, todo, tmps, forward, params, tokens_per_batch, n, len(gaps))
            except BaseException:         # a failed or interrupted shard leaves no temporary file behind
                for t in tmps.values():
                    t.unlink(missing_ok=True)
                raise
            done += P
            if log:
                rate = done / (time.perf_counter() - t0)
                di, name = self.stream.shards[s]
                log(f"shard features: shard {n + 1}/{len(gaps)} ({self.stream.dirs[di].name}/{name}, layers {todo}), "
                    f"{rate:.0f} positions/s; {done:,}/{total:,} positions, {_clock((total - done) / rate)} left")
        return done

    def _compute_shard(self, s: int, todo: list[int], tmps: dict, forward, params, tokens_per_batch: int, n: int,
                       of: int) -> None:
        """One shard's missing layers: a target forward over its sequences into `tmps`, renamed
        into place once every position is written."""
        seqs = self.stream._read(s)
        cut, offsets = self.stream.positions(s), self._offsets[s]
        D, P = self.hidden_size, int(offsets[-1])
        outs = {i: np.lib.format.open_memmap(tmps[i], mode="w+", dtype=np.dtype(self.dtype), shape=(P, D))
                for i in todo}
        limit = float(np.finfo(np.dtype(self.dtype)).max)

        def emit(q, f_TF):
            if f_TF.shape[-1] != D * len(todo):
                raise ValueError(f"the forward gave {f_TF.shape[-1]} features per position for layers {todo}, "
                                 f"expected {len(todo)} x {D}")
            f = f_TF[:cut[q]]
            if not np.isfinite(f).all():
                raise FloatingPointError(f"shard {self.stream.shards[s][1]} sequence {q}: the target's features "
                                         f"are not finite (layers {todo})")
            if np.abs(f).max() > limit:
                raise OverflowError(f"shard {self.stream.shards[s][1]} sequence {q}: a feature of magnitude "
                                    f"{np.abs(f).max():.3g} does not fit {self.dtype}; cache features as float32")
            for k, i in enumerate(todo):
                outs[i][offsets[q]:offsets[q + 1]] = f[:, k * D:(k + 1) * D]

        fn = lambda p, tokens_BW: forward(p, tokens_BW, tuple(todo))     # noqa: E731
        _data._batched_forward(fn, params, seqs, tokens_per_batch=tokens_per_batch, widths=self.stream.widths,
                               emit=emit, what=f"shard features {n + 1}/{of} (layers {todo})")
        for i in todo:
            outs[i].flush()
        del outs
        for i in todo:
            tmps[i].replace(self.path(s, i))

    def _map(self, s: int, layer: int) -> np.ndarray:
        k = (s, layer)
        if k not in self._maps:
            try:
                m = np.load(self.path(s, layer), mmap_mode="r")
            except (ValueError, OSError) as e:
                raise ValueError(f"{self.path(s, layer)}: unreadable feature cache ({e}); delete it to recompute") from None
            want = (int(self._offsets[s][-1]), self.hidden_size)
            if m.shape != want or m.dtype != np.dtype(self.dtype):
                raise ValueError(f"{self.path(s, layer)}: {m.dtype}{list(m.shape)} where the shard needs "
                                 f"{self.dtype}{list(want)} (stale feature cache?); delete it to recompute")
            self._maps[k] = m
        return self._maps[k]

    def batch(self, rows: Sequence[tuple[int, int]], B: int, W: int) -> dict:
        """``features`` [B, W, len(layers) x D] and ``final_residual`` [B, W, D] (float32) of a
        batch's (shard, sequence) rows, zero past each sequence."""
        D = self.hidden_size
        feats = np.zeros((B, W, len(self.layers) * D), np.float32)
        final = np.zeros((B, W, D), np.float32)
        for r, (s, q) in enumerate(rows):
            o, e = self._offsets[s][q], self._offsets[s][q + 1]
            for k, i in enumerate(self.layers):
                feats[r, :e - o, k * D:(k + 1) * D] = self._map(s, i)[o:e]
            final[r, :e - o] = self._map(s, self.final_layer)[o:e]
        return {"features": feats, "final_residual": final}
