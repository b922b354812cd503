"""Suffix decoding across requests: propose what most often followed the context's suffix, in the
current request and in earlier ones.

SuffixDecoding (Oliaro et al. 2024, arXiv:2411.04975) keeps suffix trees over the prompt and
earlier outputs and proposes, from the longest match of the context's suffix, the continuation
that followed it most often. Here the "tree" is a search over a token corpus held on the device:

* the corpus (`SuffixCorpus`, the drafter's params: int32 [M], documents separated by `SEP`) is
  filled on the host by a `SuffixCache`, a ring of M token slots: each finished request's prompt
  and output is appended, the oldest documents are overwritten (bounded memory), and the cache
  can be saved to and loaded from a directory (shared across `specjax generate` runs);
* a round matches the row's last n tokens (n from ``max_match`` down to ``min_match``) against
  every position of the corpus and of the row's own committed tokens; the occurrences of the
  longest suffix that matches anywhere are the candidates;
* it proposes greedily by frequency: the next token is the one that follows the most candidates
  (ties: the lowest id), the candidates that do not continue with it drop out, and so on for
  gamma tokens. Where no candidate continues, the rest of the chain repeats the last proposal.

A proposal is a deterministic function of the committed tokens and the corpus, so q is one-hot
and every verifier stays exact (a one-hot q is accepted with probability p(x)). The corpus is an
argument of every round (params), never a constant, so it may change between rounds and
requests without recompiling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafters._protocol import Capabilities
from specjax.drafters._registry import register_drafter

SEP = -1          # between documents, and in corpus slots never written


@struct.dataclass
class SuffixCorpus:
    """The drafter's params: earlier documents' tokens, int32 [M] (`SEP` between them)."""
    tokens_M: jax.Array


class SuffixCache:
    """A ring of ``capacity`` token slots on the host holding earlier documents (a prompt and its
    output each), newest last; `corpus` gives the drafter's params. A document longer than the
    ring keeps its last tokens; a document that does not fit before the ring's end starts again
    at slot 0, overwriting the oldest ones (the slots it skips become `SEP`). ``vocab_size``:
    the tokenizer's, when known: saved with the ring, so a cache of another vocabulary is refused
    when loaded, and token ids past it are refused when added."""

    def __init__(self, capacity: int, vocab_size: int | None = None):
        if capacity < 2:
            raise ValueError(f"a suffix cache needs at least 2 slots, got {capacity}")
        self.vocab_size = vocab_size
        self.tokens_M = np.full(capacity, SEP, np.int32)
        self.write = 0
        self.documents = 0

    @property
    def capacity(self) -> int:
        return self.tokens_M.shape[0]

    def add(self, tokens) -> None:
        """Append one document (a sequence of token ids >= 0) and its separator."""
        doc = np.asarray(list(tokens), np.int64)
        if doc.size == 0:
            return
        top = np.iinfo(np.int32).max if self.vocab_size is None else self.vocab_size - 1
        if (doc < 0).any() or (doc > top).any():
            raise ValueError(f"a suffix cache document holds token ids in [0, {top}]")
        doc = np.append(doc[-(self.capacity - 1):], SEP).astype(np.int32)
        if self.write + doc.size > self.capacity:
            self.tokens_M[self.write:] = SEP
            self.write = 0
        self.tokens_M[self.write:self.write + doc.size] = doc
        self.write = (self.write + doc.size) % self.capacity
        self.documents += 1

    def corpus(self) -> SuffixCorpus:
        return SuffixCorpus(tokens_M=jnp.asarray(self.tokens_M))

    def save(self, directory) -> pathlib.Path:
        """Write the ring to ``directory/suffix_cache.npz`` through a temporary file of this
        process, synced and renamed over it: a run cut off or out of disk while saving leaves the
        previous cache whole (OSError naming the file; the temporary file removed)."""
        import tempfile
        path = pathlib.Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix="suffix_cache.", suffix=".tmp.npz")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, tokens_M=self.tokens_M, write=self.write, documents=self.documents,
                         vocab_size=-1 if self.vocab_size is None else self.vocab_size)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path / "suffix_cache.npz")
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise OSError(e.errno, f"{path / 'suffix_cache.npz'} not updated ({e.strerror}); the previous cache "
                                   "is kept") from e
        return path / "suffix_cache.npz"

    @classmethod
    def load(cls, directory, capacity: int, vocab_size: int | None = None) -> "SuffixCache":
        """The cache saved in ``directory`` (a new empty one if there is none), in a ring of
        ``capacity`` slots (a saved ring of another size keeps its newest documents that fit).
        ValueError naming the file if it is not a suffix cache, or was saved for a vocabulary
        other than ``vocab_size`` (None: any)."""
        path = pathlib.Path(directory) / "suffix_cache.npz"
        if not path.exists():
            return cls(capacity, vocab_size)
        try:
            with np.load(path) as f:
                ring, write = np.asarray(f["tokens_M"], np.int64), int(f["write"])
                saved_vocab = int(f["vocab_size"]) if "vocab_size" in f.files else -1
        except Exception as e:
            raise ValueError(f"{path}: not a suffix cache ({type(e).__name__}: {str(e)[:200]})") from None
        if ring.ndim != 1 or not 0 <= write < max(ring.size, 1) or (ring < SEP).any():
            raise ValueError(f"{path}: not a suffix cache (bad ring)")
        if vocab_size is not None and saved_vocab >= 0 and saved_vocab != vocab_size:
            raise ValueError(f"{path}: a suffix cache of a {saved_vocab}-token vocabulary; this target has {vocab_size}")
        cache = cls(capacity, vocab_size if vocab_size is not None else (saved_vocab if saved_vocab >= 0 else None))
        ordered = np.concatenate([ring[write:], ring[:write]])            # oldest first
        for piece in np.split(ordered, np.flatnonzero(ordered == SEP)):
            cache.add(piece[piece != SEP])
        return cache


def _match_lengths(seq_BK, valid_BK, suffix_Bn, split: int):
    """m_BK[b, i]: how many of the row's last tokens (``suffix_Bn[:, 0]`` the last, then the
    one before, ...) equal seq[i], seq[i - 1], ...: the length of the match ending at i (0 where
    i itself does not match); a window stops at a position outside ``valid_BK`` and never
    crosses ``split`` (where the row's own tokens end and the corpus begins)."""
    n_max = suffix_Bn.shape[1]
    pos_K = jnp.arange(seq_BK.shape[1])[None]
    alive = jnp.ones(seq_BK.shape, bool)
    m_BK = jnp.zeros(seq_BK.shape, jnp.int32)
    for k in range(n_max):
        back = jnp.roll(seq_BK, k, axis=1)
        ok = jnp.roll(valid_BK, k, axis=1) & (pos_K >= k) & ((pos_K < split) | (pos_K - k >= split))
        alive &= ok & (back == suffix_Bn[:, k:k + 1]) & (suffix_Bn[:, k:k + 1] >= 0)
        m_BK += alive.astype(jnp.int32)
    return m_BK


@dataclasses.dataclass(frozen=True)
class SuffixDrafter:
    """Suffix decoding over a corpus of earlier documents and the row's own tokens (module
    docstring); params: a `SuffixCorpus` (None: the row's own tokens only)."""
    vocab_size: int
    max_match: int = 8
    min_match: int = 1

    capabilities = Capabilities()            # model-free chains; no state of its own

    def __post_init__(self):
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {self.min_match}, {self.max_match}")

    def init(self, params, prompt_BP, prompt_lengths_B, capacity):
        return None

    def forward_passes(self, gamma: int) -> int:
        return 0

    def commit(self, state, new_lengths_B, accepted=None):
        return state

    def candidates(self, params, tokens_BS, lengths_B):
        """(seq_BK, valid_BK, ends_BK, n_B): the row's tokens followed by the corpus, which of
        them are tokens (not padding or `SEP`), the positions where the longest matching suffix
        (length n_B, 0: none) ends (continuations start after them), and n_B."""
        B, S = tokens_BS.shape
        pos_S = jnp.arange(S)[None]
        own_valid = pos_S < lengths_B[:, None]
        if params is None:
            seq, valid = tokens_BS, own_valid
        else:
            M = params.tokens_M.shape[0]
            seq = jnp.concatenate([tokens_BS, jnp.broadcast_to(params.tokens_M[None], (B, M))], axis=1)
            valid = jnp.concatenate([own_valid, jnp.broadcast_to(params.tokens_M[None] != SEP, (B, M))], axis=1)
        idx_Bn = lengths_B[:, None] - 1 - jnp.arange(self.max_match)[None]
        suffix_Bn = jnp.where(idx_Bn >= 0, jnp.take_along_axis(tokens_BS, jnp.maximum(idx_Bn, 0), axis=1), -2)
        m_BK = _match_lengths(seq, valid, suffix_Bn, S)
        # a match must end before the row's last token (its own suffix is no occurrence) and have
        # a continuation after it
        K = seq.shape[1]
        pos_K = jnp.arange(K)[None]
        nxt_valid = jnp.roll(valid, -1, axis=1) & (pos_K < K - 1)
        own_end = (pos_K < S) & (pos_K < lengths_B[:, None] - 1)
        ends = (own_end | (pos_K >= S)) & nxt_valid & (m_BK >= self.min_match)
        m_BK = jnp.where(ends, m_BK, 0)
        n_B = jnp.max(m_BK, axis=1)
        return seq, valid, (m_BK == n_B[:, None]) & (n_B[:, None] > 0), n_B

    # -- as the lookup half of `HybridDrafter` (the interface `NGramDrafter` shares)
    @property
    def match_range(self) -> tuple[int, int]:
        """The shortest and longest suffix it matches."""
        return self.min_match, self.max_match

    def match(self, params, tokens_BS, lengths_B):
        """(what `follow` continues from, the longest suffix match's length [B], 0: none)."""
        seq, valid, cand_BK, n_B = self.candidates(params, tokens_BS, lengths_B)
        return (seq, valid, cand_BK), n_B

    def propose(self, params, state, context, key_B, gamma, cfg):
        tokens_BS, lengths_B = context.tokens_BS, context.lengths_B
        found, _ = self.match(params, tokens_BS, lengths_B)
        tokens_BG = self.follow(params, tokens_BS, lengths_B, found, gamma)
        return tokens_BG, jax.nn.one_hot(tokens_BG, self.vocab_size, dtype=jnp.float32), state

    def follow(self, params, tokens_BS, lengths_B, found, gamma):
        """The gamma-token proposal [B, gamma] from `match`'s candidates (module doc)."""
        seq, valid, cand_BK = found
        B, K = seq.shape
        V = self.vocab_size
        last_B = jnp.take_along_axis(tokens_BS, (lengths_B - 1)[:, None], axis=1)[:, 0]
        out = []
        for j in range(gamma):
            at_K = jnp.arange(K)[None] + 1 + j
            nxt = jnp.take_along_axis(seq, jnp.minimum(at_K, K - 1), axis=1)
            ok = cand_BK & (at_K < K) & jnp.take_along_axis(valid, jnp.minimum(at_K, K - 1), axis=1)
            counts_BV = jnp.zeros((B, V), jnp.int32).at[jnp.arange(B)[:, None], jnp.clip(nxt, 0, V - 1)].add(
                ok.astype(jnp.int32))
            found_B = ok.any(axis=1)
            choice_B = jnp.argmax(counts_BV, axis=1).astype(jnp.int32)
            prev_B = last_B if j == 0 else out[-1]
            tok_B = jnp.where(found_B, choice_B, prev_B)
            cand_BK = ok & (nxt == tok_B[:, None])
            out.append(tok_B)
        return jnp.stack(out, axis=1)


# --------------------------------------------------------------------- the registered kind
@dataclasses.dataclass(frozen=True)
class SuffixSettings:
    suffix_max_match: int = 8       # the longest suffix matched against the corpus and the request
    suffix_min_match: int = 1       # the shortest
    suffix_tokens: int = 65536      # corpus slots (a ring: the oldest documents are overwritten)
    suffix_cache_dir: str = ""      # load the corpus from here and save it after the run ("" = none)


def _build(s: SuffixSettings, ctx):
    vocab = ctx.target.vocab_size
    cache = SuffixCache.load(s.suffix_cache_dir, s.suffix_tokens, vocab) if s.suffix_cache_dir else SuffixCache(
        s.suffix_tokens, vocab)
    drafter = SuffixDrafter(ctx.target.vocab_size, max_match=s.suffix_max_match, min_match=s.suffix_min_match)
    return drafter, cache.corpus()


def _check(s: SuffixSettings, job) -> None:
    if not 1 <= s.suffix_min_match <= s.suffix_max_match:
        raise ValueError(f"suffix_min_match={s.suffix_min_match!r}, suffix_max_match={s.suffix_max_match!r}: need "
                         f"1 <= suffix_min_match <= suffix_max_match")
    if s.suffix_tokens < 2:
        raise ValueError(f"suffix_tokens={s.suffix_tokens!r}: the corpus needs at least 2 slots")
    check_cache_dir(s)
    if job.trees:
        raise ValueError(f"{job.tree_setting}={job.tree_value!r}: the suffix drafter drafts chains only")


def _describe(s: SuffixSettings, drafter, record):
    text = f"suffix decoding over the request and a corpus of {s.suffix_tokens} token slots"
    if s.suffix_cache_dir:
        text += f" (cache {s.suffix_cache_dir})"
    return text, {"suffix_cache_dir": s.suffix_cache_dir, "suffix_tokens": s.suffix_tokens}


def _after_run(s: SuffixSettings, record) -> None:
    """The run's prompt and output join the cache directory's corpus (none: nothing kept)."""
    if s.suffix_cache_dir:
        remember(s.suffix_cache_dir, s.suffix_tokens, [tuple(record.prompt_ids) + tuple(record.tokens)])


register_drafter("suffix", SuffixSettings, _build, check=_check, describe=_describe,
                 description="suffix decoding across requests", after_run=_after_run)


def remember(cache_dir: str, capacity: int, documents) -> pathlib.Path:
    """Add ``documents`` (token id sequences: a prompt and its output each) to the cache saved in
    ``cache_dir`` and save it: what `specjax generate` does after a run with ``suffix_cache_dir``.
    The read, the additions and the save hold an OS lock on the directory's
    ``suffix_cache.lock``, so runs that finish together each add their documents (none lost)."""
    import fcntl
    path = pathlib.Path(cache_dir)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "suffix_cache.lock", "a") as lock:
        with contextlib.suppress(OSError):          # a file system without locks: unlocked
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        cache = SuffixCache.load(cache_dir, capacity)
        for d in documents:
            cache.add(d)
        return cache.save(cache_dir)


def check_cache_dir(s) -> None:
    """``suffix_cache_dir`` (if set) can be a directory this run reads and writes: ValueError
    naming it before anything runs (a file there would read as an empty corpus)."""
    from specjax import files
    if s.suffix_cache_dir:
        problem = files.dir_problem(s.suffix_cache_dir)
        if problem:
            raise ValueError(f"suffix_cache_dir={s.suffix_cache_dir!r}: {problem}")


__all__ = ["SEP", "SuffixCache", "SuffixCorpus", "SuffixDrafter", "SuffixSettings", "check_cache_dir", "remember"]
