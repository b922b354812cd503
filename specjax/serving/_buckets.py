"""Batch sizes for a slot scheduler: run each round at the smallest size its busy rows need.

A round costs the same whatever share of its rows is busy (the batch shape is static), so a
scheduler of ``slots`` rows that always ran all of them would pay a full batch's round for one
request at low load. `Buckets` names the sizes a scheduler may run at (each a compiled
program; the largest is ``slots``) and moves the loop state between them with
`specjax.decoding.Engine.resize`: up when waiting requests need more rows (the busy rows keep
their places), down when the busy rows fit a smaller size (they are packed into the first
rows, in slot order). A row moved this way keeps everything that is its own (caches, tokens,
key, counters), so what a request gets does not depend on the moves.

Adaptive gamma prices rounds by the round times measured at the size a round runs at
(``round_time_s``: one entry per size, or one table for all), so the draft length follows the
batch: long where a round is bound by memory traffic and speculation is almost free, 0 where a
full batch is bound by compute (`specjax.decoding` "Adaptive draft length").
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence


def _sizes(slots: int, buckets: Sequence[int] | str) -> tuple[int, ...]:
    if buckets == "powers":
        sizes, n = [], 1
        while n < slots:
            sizes.append(n)
            n *= 2
        return tuple(sizes) + (slots,)
    if isinstance(buckets, str):
        raise ValueError(f"buckets must be 'powers' or batch sizes, got {buckets!r}")
    sizes = tuple(int(b) for b in buckets)
    if any(b < 1 or b > slots for b in sizes) or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"buckets must be distinct sorted batch sizes in [1, slots={slots}], got {tuple(buckets)}")
    return tuple(b for b in sizes if b != slots) + (slots,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The batch sizes (``sizes``, sorted, the last one the scheduler's slots) and adaptive
    gamma's round times at each (``round_time_s``: {size: times}, or None: the uncalibrated
    default; times as `specjax.decoding.Engine.round_times` measures them)."""
    sizes: tuple[int, ...]
    round_time_s: Mapping[int, Sequence[float]] | None = None

    @classmethod
    def make(cls, slots: int, buckets: Sequence[int] | str = (), round_time_s=None) -> "Buckets":
        """``buckets``: batch sizes below ``slots`` to run at ('powers': 1, 2, 4, ... below
        slots; (): always ``slots``, every round a full batch). ``round_time_s``: one sequence of
        times for every size, or a mapping size -> times covering every size."""
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        sizes = _sizes(slots, buckets)
        if round_time_s is not None:
            if isinstance(round_time_s, Mapping):
                missing = [b for b in sizes if b not in round_time_s]
                if missing:
                    raise ValueError(f"round_time_s has no times for batch size(s) {missing} (sizes {sizes})")
                round_time_s = {int(b): tuple(round_time_s[b]) for b in sizes}
            else:
                round_time_s = {b: tuple(round_time_s) for b in sizes}
        return cls(sizes=sizes, round_time_s=round_time_s)

    @property
    def slots(self) -> int:
        return self.sizes[-1]

    def times(self, size: int):
        return None if self.round_time_s is None else self.round_time_s[size]

    def size_for(self, rows: int) -> int:
        """The smallest size holding ``rows`` rows (the largest if none does)."""
        return next((b for b in self.sizes if b >= rows), self.sizes[-1])

    def fit(self, engine, state, occupant: list, waiting: int):
        """(state, occupant) at the size the busy rows (``occupant[i]`` not None) and ``waiting``
        admissible requests need: unchanged when it is the current size; grown with the busy
        rows in place; shrunk with them packed into the first rows, in order. ``occupant`` is
        per row; the returned list is the new rows' (the caller re-reads its slots from it)."""
        busy = [i for i, o in enumerate(occupant) if o is not None]
        size = self.size_for(len(busy) + waiting)
        current = len(occupant)
        if size == current:
            return state, occupant
        if size > current:
            rows = list(range(current)) + [None] * (size - current)
            return engine.resize(state, rows, self.times(size)), occupant + [None] * (size - current)
        rows = busy + [None] * (size - len(busy))
        return engine.resize(state, rows, self.times(size)), [occupant[i] for i in busy] + [None] * (size - len(busy))
