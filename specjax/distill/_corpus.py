"""A prompt corpus the target writes itself, cleaned: Magpie prefixes, deduplication, decontamination.

Magpie (Xu et al. 2024): an aligned chat model given only its template's opening of a user turn
completes it with a plausible user request. `template_prefix` renders the chat template around
a sentinel message and keeps what precedes it, so the same code serves any template. A short
system message per seed task (`SEED_TASKS`) steers what kind of request the target writes, so
that coding, math, extraction, translation, summarization, RAG-style and roleplay requests are
all present; the steering message is dropped afterwards (the request is answered under the
template's default system prompt, as a user would send it). Follow-up turns are made the same
way after a first exchange (`template_prefix` over the conversation so far).

Cleaning (`build_corpus`), in this order, each step counted per source and category:
1. rejected: empty, fewer than `MIN_WORDS` words, a generated request longer than `MAX_CHARS`
   characters (curated prompts, e.g. Spec-Bench's long summarization inputs, are kept), a
   request the target did not finish (no end-of-turn token), or one that contains template
   markers;
2. exact duplicates: the same text after `normalize` (lower case, words only);
3. near duplicates: MinHash over word 5-gram shingles with locality-sensitive hashing (Broder
   1997; Leskovec et al., Mining of Massive Datasets, ch. 3), then the true Jaccard similarity of
   each candidate pair; a text whose similarity to an earlier kept one is >= `NEAR_DUP_JACCARD`
   is dropped;
4. leaks: a text sharing any word 8-gram with a held-out or evaluation text is dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
from typing import Iterable, Sequence

import numpy as np

SENTINEL = "\u2063specjax-sentinel\u2063"
MIN_WORDS = 3
MAX_CHARS = 4000
NEAR_DUP_JACCARD = 0.7
SHINGLE = 5
LEAK_NGRAM = 8

# (category, the system message that steers a Magpie request towards it)
SEED_TASKS = (
    ("coding", "You are a programming assistant. The user asks you to write, explain or fix a piece of code."),
    ("math", "You are a math tutor. The user asks you to solve a math problem and show the steps."),
    ("extraction", "You are an information extraction assistant. The user pastes a passage of text and asks you "
                   "to extract specific facts, names or numbers from it."),
    ("translation", "You are a translator. The user gives you a sentence or a short text and asks you to translate "
                    "it into another language."),
    ("summarization", "You are a summarization assistant. The user pastes an article or a report and asks for a "
                      "short summary."),
    ("rag", "You answer questions from documents. The user gives you two or three short documents and then asks a "
            "question that the documents answer."),
    ("roleplay", "You are a role-playing partner. The user asks you to play a character or act out a scenario."),
    ("writing", "You are a writing assistant. The user asks you to write an email, a story, an essay or a poem."),
    ("reasoning", "You are a careful thinker. The user asks a puzzle or a question that needs step-by-step "
                  "reasoning."),
    ("qa", "You are a knowledgeable assistant. The user asks a factual question."),
    ("stem", "You are a science teacher. The user asks about physics, chemistry, biology or engineering."),
    ("humanities", "You are a humanities scholar. The user asks about history, philosophy, art or society."),
)


def template_prefix(tokenizer, messages: Sequence[dict], role: str = "user") -> list[int]:
    """Token ids of the chat template rendered over ``messages`` and the opening of a new turn
    of ``role``, up to where that turn's text would start (the Magpie prompt)."""
    text = tokenizer.apply_chat_template(list(messages) + [{"role": role, "content": SENTINEL}],
                                         add_generation_prompt=False, tokenize=False)
    if text.count(SENTINEL) != 1:
        raise ValueError("the chat template does not render a message's content verbatim; cannot cut a turn prefix")
    return list(tokenizer.encode(text.split(SENTINEL)[0], add_special_tokens=False))


def normalize(text: str) -> str:
    """Lower case, words only (letters and digits), single spaces."""
    return " ".join(re.findall(r"\w+", text.lower()))


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = normalize(text).split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _hash64(items: Iterable[tuple[str, ...]]) -> np.ndarray:
    return np.asarray([int.from_bytes(hashlib.blake2b(" ".join(s).encode(), digest_size=8).digest(), "little")
                       for s in items], np.uint64)


_PRIME = (1 << 61) - 1


def minhash(shingles: set, num_perm: int = 64, seed: int = 0) -> np.ndarray:
    """MinHash signature [num_perm] (uint64) of a set of shingles: min over the set of
    (a_i h + b_i) mod (2^61 - 1) for random a_i, b_i (an empty set gives all-max)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 1 << 30, num_perm, dtype=np.uint64)
    b = rng.integers(0, 1 << 30, num_perm, dtype=np.uint64)
    if not shingles:
        return np.full(num_perm, np.iinfo(np.uint64).max, np.uint64)
    h = _hash64(shingles) >> np.uint64(31)        # 33 bits: a * h + b stays below 2^64
    return ((h[:, None] * a[None, :] + b[None, :]) % np.uint64(_PRIME)).min(axis=0)


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def near_duplicates(texts: Sequence[str], threshold: float = NEAR_DUP_JACCARD, num_perm: int = 64,
                    bands: int = 16) -> list[int]:
    """Indices of texts whose word-shingle Jaccard similarity to an earlier kept text is >=
    ``threshold`` (candidates by MinHash LSH, each pair then checked exactly)."""
    rows = num_perm // bands
    shingles = [ngrams(t, SHINGLE) or ngrams(t, 1) for t in texts]
    buckets: dict[tuple, list[int]] = collections.defaultdict(list)
    dropped = []
    for i, s in enumerate(shingles):
        sig = minhash(s, num_perm)
        keys = [(band, sig[band * rows:(band + 1) * rows].tobytes()) for band in range(bands)]
        candidates = {j for k in keys for j in buckets.get(k, ())}
        if any(jaccard(s, shingles[j]) >= threshold for j in sorted(candidates)):
            dropped.append(i)
            continue
        for k in keys:
            buckets[k].append(i)
    return dropped


@dataclasses.dataclass
class Candidate:
    text: str
    source: str
    category: str
    finished: bool = True
    generated: bool = False     # written by the model (the length rule applies), not a curated prompt


def build_corpus(candidates: Sequence[Candidate], banned_texts: Sequence[str]) -> tuple[list[Candidate], dict]:
    """The cleaned corpus (candidates kept, in their order) and a report: per (source, category)
    the count offered, rejected, exact and near duplicates, leaks and kept (see the module)."""
    steps = ("offered", "rejected", "exact_duplicates", "near_duplicates", "leaks", "kept")
    counts: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)

    def note(c, step):
        counts[(c.source, c.category)][step] += 1

    alive = []
    for c in candidates:
        note(c, "offered")
        t = c.text.strip()
        if (not c.finished or len(t.split()) < MIN_WORDS or (c.generated and len(t) > MAX_CHARS) or "<|" in t
                or SENTINEL in t):
            note(c, "rejected")
        else:
            alive.append(dataclasses.replace(c, text=t))
    seen, unique = set(), []
    for c in alive:
        key = normalize(c.text)
        if key in seen:
            note(c, "exact_duplicates")
        else:
            seen.add(key)
            unique.append(c)
    near = set(near_duplicates([c.text for c in unique]))
    for i in sorted(near):
        note(unique[i], "near_duplicates")
    unique = [c for i, c in enumerate(unique) if i not in near]
    banned = set().union(*(ngrams(t, LEAK_NGRAM) for t in banned_texts)) if banned_texts else set()
    kept = []
    for c in unique:
        if ngrams(c.text, LEAK_NGRAM) & banned:
            note(c, "leaks")
        else:
            note(c, "kept")
            kept.append(c)
    rows = [{"source": s, "category": cat, **{k: counts[(s, cat)][k] for k in steps}}
            for (s, cat) in sorted(counts)]
    total = {k: sum(r[k] for r in rows) for k in steps}
    return kept, {"rows": rows, "total": total, "banned_texts": len(banned_texts),
                  "near_dup_jaccard": NEAR_DUP_JACCARD, "leak_ngram": LEAK_NGRAM, "shingle": SHINGLE}


def report_markdown(report: dict) -> str:
    cols = ("offered", "rejected", "exact_duplicates", "near_duplicates", "leaks", "kept")
    lines = ["| source | category | " + " | ".join(cols) + " |", "|---|---|" + "---:|" * len(cols)]
    for r in report["rows"]:
        lines.append(f"| {r['source']} | {r['category']} | " + " | ".join(str(r[c]) for c in cols) + " |")
    t = report["total"]
    lines.append("| **all** | | " + " | ".join(f"**{t[c]}**" for c in cols) + " |")
    return "\n".join(lines) + "\n"
