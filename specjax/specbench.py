"""Spec-Bench prompts (Xia et al. 2024), shipped with the package, and the held-out split.

The split is fixed once here: a question is *held out* when ``question_id % 4 == 0``
(120 of 480, every category represented). Benchmarks use only held-out questions;
distillation trains only on the others, so reported acceptance is never measured on
training prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

PATH = pathlib.Path(__file__).with_name("data") / "spec_bench_question.jsonl"
SHA256 = "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
              "humanities", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclasses.dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    turns: tuple[str, ...]

    @property
    def prompt(self) -> str:
        """The first turn: what a single-turn benchmark sends."""
        return self.turns[0]

    @property
    def held_out(self) -> bool:
        return is_held_out(self.question_id)


def is_held_out(question_id: int) -> bool:
    return question_id % 4 == 0


def load(path: str | pathlib.Path | None = None, *, split: str = "all") -> list[Question]:
    """All questions (``split='all'``), or the ``'held_out'`` / ``'train'`` part."""
    path = pathlib.Path(path) if path is not None else PATH
    raw = path.read_bytes()
    if path == PATH and hashlib.sha256(raw).hexdigest() != SHA256:
        raise ValueError(f"{path} does not match the recorded sha256 {SHA256}")
    out = []
    for line in raw.decode("utf-8").splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(Question(int(d["question_id"]), d["category"], tuple(d["turns"])))
    if split == "held_out":
        out = [q for q in out if q.held_out]
    elif split == "train":
        out = [q for q in out if not q.held_out]
    elif split != "all":
        raise ValueError(f"unknown split {split!r}: expected 'all', 'held_out' or 'train'")
    return out


def one_per_category(split: str = "held_out") -> list[Question]:
    """The first question of each category (13 prompts), in CATEGORIES order."""
    first = {}
    for q in load(split=split):
        first.setdefault(q.category, q)
    return [first[c] for c in CATEGORIES]
