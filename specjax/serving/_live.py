"""The slot scheduler on the real clock, for a server: one engine thread, requests at any time.

`LiveScheduler` owns one engine's loop state of ``slots`` rows, as `Scheduler` does, but takes
requests while it runs: `submit` queues one (FIFO; a full queue raises `QueueFull`), the engine
thread prefills it into a free slot (`Engine.refill`) and runs rounds (`Engine.step`) while any
slot is busy, and calls the request's ``on_event`` from the engine thread with each round's new
tokens and, at the end, with its finish reason and counters. `cancel` frees a request's slot at
the next round (its row is marked done; a later request refills it). A request's own
``max_tokens`` (at most the engine's ``max_new_tokens``) and its ``stop`` test (stop sequences,
checked after each round on its tokens) end it host-side, the same way.

Batch sizes: with ``buckets`` the engine's rounds run at the smallest of several batch sizes
that holds the busy rows and the queue (`Buckets`; rows move whole between sizes, a moved
ticket's ``slot`` is rewritten), and adaptive gamma prices each round with the round times
measured at its size (``round_time_s``: size -> times).

Sampling per request: a request may bring its own temperature, top-k, top-p, min-p, logit
bias and repetition / presence / frequency penalties (``settings``; default the scheduler's) and
``seed``. A round where every busy row is greedy without a logit bias or a penalty runs the
greedy program (`SamplingConfig.greedy_config`); a round where some busy row has a penalty runs
the per-row program with penalties (it counts each row's token history every round); any other
round runs the per-row program (`SamplingConfig.rows`, each slot its occupant's settings): three
compiled programs for every mix, and a fourth when some busy row has an automaton (structured
output, ``constraint``: the per-row program with penalties and a stacked automata table of a fixed
size, `specjax.constraints.stack`); `warmup` compiles the four. A greedy row gets the same tokens from either; with token trees it
drafts less well in a per-row round (its one-hot q gives each node one child worth verifying).

What a request gets is what it would get decoded alone, as with `Scheduler`: its key is
``fold_in(key, id)`` (with a seed, ``fold_in(jax.random.key(seed), 0)``, so the same seed and
prompt give the same tokens whatever else runs), its counters are its own, and its row's rounds do not depend on the other
rows (a fixed gamma; under adaptive gamma the draft length is the batch's). Greedy answers are
the target's greedy tokens.

Events (dicts): ``{"type": "tokens", "ids": [...]}`` after a round that committed tokens;
``{"type": "done", "finish_reason": "stop" | "length" | "cancelled" | "error", "status": ...,
"usage": {...}}`` once, last. ``usage`` holds the engine's per-row counters: target passes,
proposed and accepted drafts.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from specjax import constraints, decoding
from specjax import sampling as sampling_lib
from specjax.serving._buckets import Buckets
from specjax.serving._scheduler import row_counters

# The largest seed a request may bring (a uint32: `jax.random.key` takes it as it is).
MAX_SEED = 2 ** 32 - 1


class QueueFull(Exception):
    """The scheduler's queue holds ``max_queue`` requests already."""


class Stopped(Exception):
    """The scheduler is draining or stopped: it takes no new request."""


@dataclasses.dataclass(eq=False)
class Ticket:
    """One submitted request, as the engine thread tracks it."""
    id: int
    prompt: tuple[int, ...]
    max_tokens: int
    on_event: Callable[[dict], None]
    arrival: float
    cancelled: bool = False
    tokens: list = dataclasses.field(default_factory=list)
    slot: int | None = None
    admitted: float | None = None
    first: float | None = None
    # temperature, top_k, top_p, min_p, logit bias (id, value) pairs, repetition, presence, frequency
    settings: tuple = (0.0, 0, 1.0, 0.0, (), 1.0, 0.0, 0.0)
    seed: int | None = None
    stop: Callable[[list], bool] | None = None             # True once the tokens hold a stop sequence
    constraint: Any = None                                  # a `specjax.constraints.TokenAutomaton`, or None
    stopped: bool = False
    stop_error: str | None = None


_FINISH = {"eos": "stop", "max_new_tokens": "length", "nan_logits": "error"}


def _settings_of(sampling) -> tuple:
    """A scalar `SamplingConfig` as a request's settings (no min-p, no logit bias)."""
    if sampling.per_row:
        raise ValueError("the scheduler's default sampling must be one setting (SamplingConfig.make)")
    penalties = (1.0, 0.0, 0.0) if not sampling.penalized else tuple(
        float(x) for x in (sampling.repetition, sampling.presence, sampling.frequency))
    return (float(sampling.temperature), int(sampling.top_k), float(sampling.top_p), 0.0, ()) + penalties


def _penalized(settings: tuple) -> bool:
    return settings[5:] != (1.0, 0.0, 0.0)


def check_request_settings(settings) -> tuple:
    """(temperature, top_k, top_p[, min_p[, logit_bias[, repetition, presence, frequency]]])
    checked (`sampling.check_settings`, `sampling.check_logit_bias`, `sampling.check_penalties`)
    as a hashable 8-tuple; ValueError naming the bad one."""
    settings = tuple(settings)
    if not (3 <= len(settings) <= 5 or len(settings) == 8):
        raise ValueError("settings are (temperature, top_k, top_p[, min_p[, logit_bias[, repetition, presence, "
                         f"frequency]]]), got {settings!r}")
    t, k, p, m = sampling_lib.check_settings(*settings[:3], settings[3] if len(settings) > 3 else 0.0)
    bias = sampling_lib.check_logit_bias(dict(settings[4]) if len(settings) > 4 and settings[4] else None)
    penalties = sampling_lib.check_penalties(*settings[5:8])
    return (t, k, p, m, tuple(sorted(bias.items()))) + penalties


class LiveScheduler:
    """Serve requests through ``slots`` rows of one engine in a thread (module docstring).

    ``capacity``: cache slots per row, for every request (`submit` refuses a prompt that does
    not fit with its max_tokens); prompts are padded to ``pad_multiple`` (one compiled refill
    per padded width)."""

    def __init__(self, engine: decoding.Engine, params: decoding.EngineParams, sampling, *, slots: int,
                 capacity: int, key, max_queue: int = 64, pad_multiple: int = 64, max_constraint_states: int = 1024,
                 max_constraint_classes: int = 1024, buckets: Sequence[int] | str = (), round_time_s=None):
        if slots < 1 or max_queue < 1:
            raise ValueError(f"slots and max_queue must be >= 1, got {slots} and {max_queue}")
        # the batch sizes rounds run at and adaptive gamma's round times at each (`Buckets`)
        self.buckets = Buckets.make(slots, buckets, round_time_s)
        # the stacked automata table of a constrained round (`constraints.stack`): a fixed shape
        self.max_constraint_states, self.max_constraint_classes = max_constraint_states, max_constraint_classes
        self.engine, self.params, self.sampling = engine, params, sampling
        self.default_settings = _settings_of(sampling)
        self._greedy = sampling_lib.SamplingConfig.greedy_config()
        self._rows_cache: tuple | None = None        # (slot settings, SamplingConfig.rows of them)
        self.slots, self.capacity, self.key = slots, capacity, key
        self.max_queue, self.pad_multiple = max_queue, pad_multiple
        self.max_new_tokens = engine.config.max_new_tokens
        self._lock = threading.Condition()
        self._queue: collections.deque[Ticket] = collections.deque()
        self._occupant: list[Ticket | None] = [None] * self.buckets.sizes[0]     # one per row of the state
        self._next_id = 0
        self._accepting = True
        self._running = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.started = time.perf_counter()
        # host-side figures for /metrics (written by the engine thread, read under the lock)
        self.stats = {"requests_total": 0, "finished_total": 0, "cancelled_total": 0, "tokens_total": 0,
                      "rounds_total": 0, "proposed_total": 0, "accepted_total": 0,
                      "gamma_rounds": [0] * len(engine.config.gammas), "resizes_total": 0}
        # finished rows' drafts, per draft position: accepted, and reached verification
        self.accepted_at = np.zeros(engine.config.max_gamma, np.int64)
        self.tested_at = np.zeros(engine.config.max_gamma, np.int64)

    # ------------------------------------------------------------------ requests (any thread)

    def room(self, prompt_tokens: int) -> int:
        """The most new tokens a prompt of this length can get here: the engine's
        ``max_new_tokens`` when the prompt, padded, fits the cache with them and the
        verification block (`GenerationConfig.slots_needed`); else 0."""
        padded = -(-prompt_tokens // self.pad_multiple) * self.pad_multiple
        fits = self.engine.config.slots_needed(prompt_tokens) <= self.capacity and padded <= self.capacity
        return self.max_new_tokens if fits else 0

    def submit(self, prompt: Sequence[int], max_tokens: int, on_event: Callable[[dict], None], *,
               settings: tuple | None = None, seed: int | None = None,
               stop: Callable[[list], bool] | None = None, constraint=None) -> Ticket:
        """Queue a request; `QueueFull` when ``max_queue`` wait already, `Stopped` while draining.
        ValueError when the prompt and ``max_tokens`` do not fit (`room`), or naming a bad
        sampling setting (``settings``: (temperature, top_k, top_p[, min_p[, logit_bias[,
        repetition, presence, frequency]]]), the bias a dict token id -> value; None: the
        scheduler's) or seed (an integer in
        [0, `MAX_SEED`]). ``stop(tokens)``: True ends the request ("stop"). ``constraint``: a
        `specjax.constraints.TokenAutomaton` its tokens must follow (structured output); ValueError
        if it is over another vocabulary or larger than the scheduler's table."""
        prompt = tuple(decoding.token_ids(prompt, "prompt"))
        if not prompt:
            raise ValueError("the prompt is empty")
        room = self.room(len(prompt))
        if max_tokens < 1 or max_tokens > room:
            raise ValueError(f"max_tokens={max_tokens}: a prompt of {len(prompt)} tokens leaves room for 1 to {room} "
                             f"new tokens here (cache {self.capacity} slots, at most {self.max_new_tokens} new tokens)")
        settings = self.default_settings if settings is None else check_request_settings(settings)
        vocab = self.engine.target.vocab_size
        outside = [i for i, _ in settings[4] if i >= vocab]
        if outside:
            raise ValueError(f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {vocab})")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                                 or not 0 <= seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer from 0 to {MAX_SEED}, got {seed!r}")
        if constraint is not None:
            if constraint.class_V.shape[0] != vocab:
                raise ValueError(f"constraint: compiled for {constraint.class_V.shape[0]} tokens, the target has {vocab}")
            if constraint.num_states > self.max_constraint_states or \
                    constraint.num_classes > self.max_constraint_classes:
                raise ValueError(f"constraint: {constraint.num_states} states and {constraint.num_classes} token "
                                 f"classes, this server takes at most {self.max_constraint_states} and "
                                 f"{self.max_constraint_classes}")
        with self._lock:
            if not self._accepting:
                raise Stopped("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are waiting already (max_queue={self.max_queue})")
            t = Ticket(id=self._next_id, prompt=prompt, max_tokens=int(max_tokens), on_event=on_event,
                       arrival=time.perf_counter(), settings=settings, seed=None if seed is None else int(seed),
                       stop=stop, constraint=constraint)
            self._next_id = (self._next_id + 1) % (2 ** 32)
            self._queue.append(t)
            self.stats["requests_total"] += 1
            self._lock.notify_all()
        return t

    def cancel(self, ticket: Ticket) -> None:
        """Stop a request: out of the queue now, out of its slot at the next round."""
        with self._lock:
            ticket.cancelled = True
            self._lock.notify_all()

    def snapshot(self) -> dict:
        """Figures for /metrics and /health: queue depth, active slots, totals since start."""
        with self._lock:
            return {**self.stats, "gamma_rounds": list(self.stats["gamma_rounds"]), "queue_depth": len(self._queue),
                    "active_slots": sum(o is not None for o in self._occupant), "slots": self.slots,
                    "batch_rows": len(self._occupant),
                    "uptime_s": time.perf_counter() - self.started, "running": self._running,
                    "accepted_at": self.accepted_at.tolist(), "tested_at": self.tested_at.tolist(),
                    "error": None if self._error is None else f"{type(self._error).__name__}: {self._error}"}

    # ------------------------------------------------------------------ the engine thread

    def warmup(self, widths: Sequence[int] = (1,), greedy_only: bool = False) -> None:
        """Compile, at every batch size (`Buckets`), the refill for prompts of these lengths'
        padded widths and the round of the four programs (greedy, per-row, with penalties, with
        penalties and automata; under adaptive gamma, each draft length's; ``greedy_only``: the
        greedy one alone, for a workload of greedy requests), and the moves between sizes, on
        throw-away states (so no request waits for compilation)."""
        for size in self.buckets.sizes:
            state = self.engine.empty_state(self.params, size, self.capacity, self.buckets.times(size), key=self.key)
            for n in widths:
                state = self.engine.refill(self.params, state, 0, self._batch(Ticket(0, (1,) * n, 1, None, 0.0)))
            self.engine.precompile(self.params, self._greedy, state)
            state = jax.block_until_ready(self.engine.step(self.params, self._greedy, state)[0])
            state = self.engine.refill(self.params, state, 0, self._batch(Ticket(0, (1,) * widths[0], 1, None, 0.0)))
            free = (self.default_settings,) * size
            for penalized, automata in () if greedy_only else ((False, None), (True, None), (True, (None,) * size)):
                rows = self._rows(free, penalized, automata)
                self.engine.precompile(self.params, rows, state)
                state = jax.block_until_ready(self.engine.step(self.params, rows, state)[0])    # the state is donated
            for other in self.buckets.sizes:
                if other != size:
                    jax.block_until_ready(self.engine.resize(state, [0] + [None] * (other - 1),
                                                             self.buckets.times(other)))

    def _rows(self, settings, penalized: bool, automata=None) -> sampling_lib.SamplingConfig:
        """The per-row config of each slot's settings: with penalties (``penalized``), and with
        the slots' automata stacked in the fixed table (``automata``, one or None per slot; a
        constrained round always carries the penalties too: one program fewer)."""
        t, k, p, m, bias, rep, pres, freq = zip(*settings)
        extra = dict(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq) if penalized else {}
        if automata is not None:
            extra["constraint"] = constraints.stack(automata, self.engine.target.vocab_size,
                                                    self.max_constraint_states, self.max_constraint_classes)
        return sampling_lib.SamplingConfig.rows(t, k, p, m, [dict(b) for b in bias], **extra)

    def _sampling_for(self, busy: Sequence[int]):
        """The round's sampling: greedy when every busy row is (no bias, no penalty), else each
        slot's settings per row (free slots the default's), with penalties when a busy row has one
        (rebuilt only when the slots' settings change)."""
        occupants = [self._occupant[s] for s in busy]
        if all(t.settings[0] == 0.0 and not t.settings[4] and not _penalized(t.settings) and t.constraint is None
               for t in occupants):
            return self._greedy
        settings = tuple(o.settings if o is not None else self.default_settings for o in self._occupant)
        automata = None
        if any(t.constraint is not None for t in occupants):
            automata = tuple(o.constraint if o is not None else None for o in self._occupant)
        penalized = automata is not None or any(_penalized(t.settings) for t in occupants)
        key = (settings, penalized, automata)       # automata compare by identity (and stay referenced)
        if self._rows_cache is None or self._rows_cache[0] != key:
            self._rows_cache = (key, self._rows(settings, penalized, automata))
        return self._rows_cache[1]

    def start(self) -> None:
        with self._lock:
            if self._running:
                return
            self._running = True
        self._thread = threading.Thread(target=self._loop, name="specjax-engine", daemon=True)
        self._thread.start()

    def stop(self, drain_s: float = 30.0) -> None:
        """Take no new request, let the queued and running ones finish (up to ``drain_s``),
        cancel what is left, then end the engine thread."""
        deadline = time.perf_counter() + drain_s
        with self._lock:
            self._accepting = False
            while (self._queue or any(self._occupant)) and self._running:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._lock.wait(min(left, 0.1))
            for t in list(self._queue) + [o for o in self._occupant if o is not None]:
                t.cancelled = True
            self._lock.notify_all()
        deadline = time.perf_counter() + 30.0
        while self._thread is not None and self._thread.is_alive() and time.perf_counter() < deadline:
            with self._lock:
                if not (self._queue or any(self._occupant)):
                    self._running = False
                    self._lock.notify_all()
            self._thread.join(0.1)

    def _seeded_key(self, seed: int):
        """A request's key from its seed, of the scheduler key's kind (typed or a legacy uint32 key)."""
        if jax.dtypes.issubdtype(self.key.dtype, jax.dtypes.prng_key):
            return jax.random.key(seed, impl=jax.random.key_impl(self.key))
        return jax.random.PRNGKey(seed)

    def _batch(self, t: Ticket) -> decoding.Batch:
        key, rid = (self.key, t.id) if t.seed is None else (self._seeded_key(t.seed), 0)
        return decoding.make_batch([t.prompt], self.engine.config, key, request_ids=[rid],
                                   pad_multiple=self.pad_multiple, capacity=self.capacity)

    def _finish(self, t: Ticket, reason: str, status: str, counters: dict | None) -> None:
        if t.slot is not None:
            self._occupant[t.slot] = None
        self.stats["finished_total"] += 1
        self.stats["cancelled_total"] += reason == "cancelled"
        usage = {"prompt_tokens": len(t.prompt), "completion_tokens": len(t.tokens),
                 "total_tokens": len(t.prompt) + len(t.tokens)}
        if counters:
            passes = counters["target_passes"]
            usage.update(target_passes=passes, proposed=counters["proposed"], accepted=counters["accepted"],
                         accepted_tokens_per_pass=round(len(t.tokens) / passes, 4) if passes else None)
        now = time.perf_counter()
        usage["ttft_s"] = None if t.first is None else round(t.first - t.arrival, 6)
        usage["latency_s"] = round(now - t.arrival, 6)
        self._emit(t, {"type": "done", "finish_reason": reason, "status": status, "usage": usage})

    def _emit(self, t: Ticket, event: dict) -> None:
        """``t.on_event(event)``; a callback that fails (its client's event loop gone) cancels its
        request instead of stopping the engine thread."""
        try:
            t.on_event(event)
        except Exception:  # noqa: BLE001 - the request's receiver is gone, not the engine
            t.cancelled = True

    def _loop(self) -> None:
        engine, params = self.engine, self.params
        try:
            size = self.buckets.sizes[0]
            state = engine.empty_state(params, size, self.capacity, self.buckets.times(size), key=self.key)
            while True:
                if len(self.buckets.sizes) > 1:
                    state = self._fit(state)
                with self._lock:
                    # cancelled requests leave the queue and their slots (the row is marked done)
                    for t in [t for t in self._queue if t.cancelled]:
                        self._queue.remove(t)
                        self._finish(t, "cancelled", "cancelled", None)
                    freed = [s for s, o in enumerate(self._occupant) if o is not None and o.cancelled]
                    admit = []
                    for s in range(len(self._occupant)):
                        if (self._occupant[s] is None or s in freed) and self._queue and s not in freed:
                            admit.append((s, self._queue.popleft()))
                    busy = [s for s, o in enumerate(self._occupant) if o is not None and not o.cancelled] + \
                        [s for s, _ in admit]
                    if not busy and not freed:
                        if not self._running:
                            return
                        self._lock.wait(0.05)
                        continue
                if freed:
                    m = jax.device_get(state.metrics)
                    for s in freed:
                        state = state.replace(done_B=state.done_B.at[s].set(True))
                        with self._lock:
                            self._finish(self._occupant[s], "cancelled", "cancelled", self._counters(m, s))
                for s, t in admit:
                    t.slot, t.admitted = s, time.perf_counter()
                    state = engine.refill(params, state, s, self._batch(t))
                    with self._lock:
                        self._occupant[s] = t
                if not busy:
                    continue
                with self._lock:
                    sampling = self._sampling_for(busy)
                state, commit = engine.step(params, sampling, state)
                # one transfer a round: the commit and the batch's rounds per gamma
                c, gamma_rounds = jax.device_get((commit, state.metrics.gamma_rounds_Z))
                now = time.perf_counter()
                ended, fresh = [], []
                with self._lock:
                    self.stats["rounds_total"] += 1
                    for s in busy:
                        t = self._occupant[s]
                        n = int(c.n_B[s])
                        new = [int(x) for x in c.tokens_BC[s, :n]][:t.max_tokens - len(t.tokens)]
                        if new:
                            t.tokens.extend(new)
                            t.first = t.first if t.first is not None else now
                            self.stats["tokens_total"] += len(new)
                            self._emit(t, {"type": "tokens", "ids": new})
                            fresh.append(s)
                        if bool(c.done_B[s]) or len(t.tokens) >= t.max_tokens:
                            ended.append(s)
                # Stop tests (they decode the text) outside the lock: only this thread changes
                # the occupants' tokens. A test that raises ends its own request, not the thread.
                for s in fresh:
                    t = self._occupant[s]
                    if t.stop is not None:
                        try:
                            t.stopped = bool(t.stop(t.tokens))
                        except Exception as e:  # noqa: BLE001
                            t.stopped, t.stop_error = True, f"{type(e).__name__}: {e}"
                        if t.stopped and s not in ended:
                            ended.append(s)
                if ended:
                    status_B, m = jax.device_get((state.status_B, state.metrics))
                    for s in ended:
                        t = self._occupant[s]
                        status = decoding.STATUS_NAMES[int(status_B[s])]
                        reason = _FINISH.get(status, "length")
                        if status == "running":          # its own max_tokens or stop: the row stops here
                            state = state.replace(done_B=state.done_B.at[s].set(True))
                            status, reason = "max_tokens", "length"
                        if t.stop_error is not None:
                            status, reason = f"stop test failed: {t.stop_error}", "error"
                        elif t.stopped:                  # a stop sequence, whatever else ended the row
                            status, reason = "stop_sequence", "stop"
                        counters = self._counters(m, s)
                        with self._lock:
                            self._finish(t, reason, status, counters)
                with self._lock:
                    self.stats["gamma_rounds"] = [int(x) for x in gamma_rounds]
                    self._lock.notify_all()
        except BaseException as e:        # noqa: BLE001 - every waiting request is told
            with self._lock:
                self._error = e
                self._running = False
                self._accepting = False
                for t in list(self._queue) + [o for o in self._occupant if o is not None]:
                    self._emit(t, {"type": "done", "finish_reason": "error", "status": f"{type(e).__name__}: {e}",
                                   "usage": {"prompt_tokens": len(t.prompt), "completion_tokens": len(t.tokens),
                                             "total_tokens": len(t.prompt) + len(t.tokens)}})
                self._queue.clear()
                self._occupant = [None] * self.slots
                self._lock.notify_all()
            raise

    def _fit(self, state):
        """The state at the batch size the busy rows and the queue need (`Buckets.fit`); only
        this thread changes which rows hold which request, so the moved tickets' slots are
        rewritten under the lock with the new row list."""
        with self._lock:
            occupant, waiting = list(self._occupant), sum(1 for t in self._queue if not t.cancelled)
        state, moved = self.buckets.fit(self.engine, state, occupant, waiting)
        if len(moved) != len(occupant) or any(a is not b for a, b in zip(moved, occupant)):
            with self._lock:
                self._occupant = moved
                for i, t in enumerate(moved):
                    if t is not None:
                        t.slot = i
                self.stats["resizes_total"] += 1
        return state

    def _counters(self, m, slot: int) -> dict:
        """A finished row's counters from the host metrics ``m``, added to the totals."""
        counters = row_counters(m, slot)
        with self._lock:
            self.stats["proposed_total"] += counters["proposed"]
            self.stats["accepted_total"] += counters["accepted"]
            if self.accepted_at.size:
                self.accepted_at += np.asarray(m.accepted_at_BG)[slot, :self.accepted_at.size].astype(np.int64)
                self.tested_at += np.asarray(m.tested_at_BG)[slot, :self.tested_at.size].astype(np.int64)
        return counters
