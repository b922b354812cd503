"""A request scheduler that keeps a fixed batch of slots full (continuous batching).

The engine's loop state has ``slots`` rows. Each request waits in a FIFO queue until it has
arrived and a slot is free; then its prompt is prefilled into that row (`Engine.refill`: one
jitted call, the other rows keep their caches and progress and resume at the next round), and
from then on the row takes part in every engine round (`Engine.step`). When a row finishes
(EOS, max_new_tokens, NaN logits) its result is read and the slot is refilled with the next
waiting request. Empty slots are done rows: masked, but a round costs the same with them
(the batch shape is static, one compiled program per shape); with ``buckets`` the rounds run at
the smallest of several batch sizes that holds the busy rows and the arrived requests waiting
(`Buckets`: rows are moved whole between sizes, so what a request gets does not change).

Admission is FIFO by arrival time, ties in the order the requests are given.

What a request sees is its own: its key is ``fold_in(key, request_id)`` (as `make_batch`),
its counters are reset when it enters a slot, and with a fixed gamma its tokens are those it
would get decoded alone (tests/test_serving.py). With adaptive gamma the draft length is
chosen per round for the whole batch, so the realised sample (never its distribution) can
depend on the other requests.

Time: ``clock='virtual'`` (default) measures every prefill and round with the wall clock but
skips the time in which nothing is queued or running (the server would sleep until the next
arrival), so a load study at low rates does not wait for idle gaps; ``'real'`` sleeps them.
Arrival times are seconds from the start of `run`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from specjax import decoding
from specjax import sampling as sampling_lib
from specjax.serving._buckets import Buckets

ROW_COUNTERS = ("rounds_B", "draft_passes_B", "proposed_B", "accepted_B", "committed_B", "degenerate_residual_B",
                "invalid_draft_rounds_B", "scored_B")


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: token ids of its prompt and its arrival time (s from the start).

    The id is an integer in [0, 2**32) (its key is ``fold_in(key, id)``, a uint32: refused
    outside, never wrapped, so distinct ids keep distinct keys) and the token ids are integers
    (1.7 or 2.0 is refused, not truncated); each error names the request and the bad value."""
    id: int
    prompt: tuple[int, ...]
    arrival_s: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "id", decoding.check_request_id(self.id))
        object.__setattr__(self, "prompt", tuple(decoding.token_ids(self.prompt, f"request {self.id}")))
        if not self.prompt:
            raise ValueError(f"request {self.id} has an empty prompt")
        if not np.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"request {self.id}: arrival_s must be finite and >= 0, got {self.arrival_s}")


@dataclasses.dataclass
class RequestResult:
    """A finished served request: its tokens, status, its own counters and its times (s from the
    start); `decoding.generate_batched` gives a plain `decoding.BatchedResult` instead.

    queue_delay_s: arrival -> admitted into a slot; ttft_s: arrival -> first committed token
    (queue delay, prefill and the first round; NaN for a request that committed none, e.g. NaN
    logits in its first round); inter_token_s: mean time between its tokens
    after the first (NaN with one token); latency_s: arrival -> last token."""
    id: int
    prompt_tokens: int
    tokens: list[int]
    status: str
    slot: int
    arrival_s: float
    admitted_s: float
    first_token_s: float
    finished_s: float
    counters: dict

    @property
    def queue_delay_s(self) -> float:
        return self.admitted_s - self.arrival_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.arrival_s

    @property
    def inter_token_s(self) -> float:
        n = len(self.tokens)
        return (self.finished_s - self.first_token_s) / (n - 1) if n > 1 else float("nan")

    def record(self) -> dict:
        """A JSON-ready row (times rounded to microseconds)."""
        r = lambda x: None if not np.isfinite(x) else round(float(x), 6)    # noqa: E731
        return {"id": self.id, "prompt_tokens": self.prompt_tokens, "tokens": len(self.tokens), "status": self.status,
                "slot": self.slot, "arrival_s": r(self.arrival_s), "queue_delay_s": r(self.queue_delay_s),
                "ttft_s": r(self.ttft_s), "inter_token_s": r(self.inter_token_s), "latency_s": r(self.latency_s),
                **self.counters}


@dataclasses.dataclass
class ServeOutput:
    results: list[RequestResult]      # in request-id order
    summary: dict
    steps: list[tuple[float, int]]    # (time after the round, active slots during it) per engine round


def row_counters(metrics, slot: int) -> dict:
    """One row's counters from the loop state's metrics (on the host): `ROW_COUNTERS` without
    their ``_B``, ``rounds`` named ``target_passes`` and ``degenerate_residual`` plural."""
    counters = {name.removesuffix("_B"): int(np.asarray(getattr(metrics, name))[slot]) for name in ROW_COUNTERS}
    counters["target_passes"] = counters.pop("rounds")
    counters["degenerate_residuals"] = counters.pop("degenerate_residual")
    return counters


def poisson_arrivals(n: int, rate_per_s: float, seed: int) -> np.ndarray:
    """Arrival times (s) of a Poisson process: n exponential gaps of mean 1/rate, cumulated
    (host-side numpy randomness: the arrival process is the workload, not the sampler)."""
    if n < 0 or not rate_per_s > 0:
        raise ValueError(f"poisson_arrivals needs n >= 0 and rate > 0, got n={n}, rate={rate_per_s}")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=n))


def gamma_arrivals(n: int, rate_per_s: float, burstiness: float, seed: int) -> np.ndarray:
    """Arrival times (s) of a renewal process with gamma-distributed gaps of mean 1/rate and
    shape ``burstiness`` (the coefficient of variation of the gaps is 1/sqrt(burstiness)): 1 is
    Poisson, below 1 the requests come in bursts with longer idle gaps between them, above 1 more
    evenly (the convention of vLLM's serving benchmark)."""
    if n < 0 or not rate_per_s > 0 or not burstiness > 0:
        raise ValueError(f"gamma_arrivals needs n >= 0, rate > 0 and burstiness > 0, got n={n}, rate={rate_per_s}, "
                         f"burstiness={burstiness}")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate_per_s * burstiness), size=n)
    return np.cumsum(gaps)


def _pct(xs, q):
    xs = [x for x in xs if np.isfinite(x)]
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(results: Sequence[RequestResult], steps: Sequence[tuple[float, int]], slots: int,
              gamma_rounds: Sequence[int], prefill_s: float) -> dict:
    """Aggregate figures of one served workload (see `RequestResult` for the times)."""
    tokens = sum(len(r.tokens) for r in results)
    start = min(r.arrival_s for r in results)
    makespan = max(r.finished_s for r in results) - start
    total = lambda name: int(sum(r.counters[name] for r in results))      # noqa: E731
    row_rounds, proposed, accepted = total("target_passes"), total("proposed"), total("accepted")
    out = {"requests": len(results), "slots": slots, "tokens": tokens, "makespan_s": makespan,
           "throughput_tok_s": tokens / makespan if makespan > 0 else float("nan"),
           "engine_rounds": len(steps), "row_rounds": row_rounds,
           "mean_active_slots": float(np.mean([a for _, a in steps])) if steps else 0.0,
           "proposed": proposed, "accepted": accepted, "wasted": proposed - accepted,
           "acceptance_rate": accepted / proposed if proposed else float("nan"),
           "mean_accepted_tokens_per_pass": tokens / row_rounds if row_rounds else float("nan"),
           "degenerate_residuals": total("degenerate_residuals"),
           "rounds_per_gamma": [int(g) for g in gamma_rounds], "prefill_s": prefill_s,
           "statuses": dict(collections.Counter(r.status for r in results))}
    for name in ("ttft_s", "inter_token_s", "queue_delay_s", "latency_s"):
        xs = [getattr(r, name) for r in results]
        out[f"{name}_mean"] = float(np.nanmean(xs)) if any(np.isfinite(xs)) else float("nan")
        out[f"{name}_p50"], out[f"{name}_p90"] = _pct(xs, 50), _pct(xs, 90)
    return out


class _Clock:
    def __init__(self, mode: str):
        if mode not in ("virtual", "real"):
            raise ValueError(f"clock must be 'virtual' or 'real', got {mode!r}")
        self.mode, self.t0, self.skipped = mode, time.perf_counter(), 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0 + self.skipped

    def wait_until(self, t: float):
        gap = t - self.now()
        if gap > 0:
            if self.mode == "real":
                time.sleep(gap)
            else:
                self.skipped += gap


@dataclasses.dataclass
class Scheduler:
    """Serve requests through ``slots`` rows of one engine (see the module doc).

    capacity: cache slots per row (every request's padded prompt, and its prompt +
    max_new_tokens + the verification block, must fit; default: what the longest prompt of a
    `run` needs, rounded up to ``pad_multiple``, as `make_batch`); prompts are padded to a multiple of ``pad_multiple`` (one compiled
    refill per padded width). ``round_time_s`` feeds adaptive gamma (as `Generator`'s): one
    sequence of round times, or with ``buckets`` a mapping batch size -> times measured there.

    buckets: batch sizes below ``slots`` the rounds may run at (`Buckets`; 'powers' = 1, 2, 4,
    ...; () = every round at ``slots`` rows): each round runs at the smallest size that holds
    the busy rows and the arrived requests waiting for one."""
    engine: decoding.Engine
    params: decoding.EngineParams
    slots: int
    pad_multiple: int = 64
    capacity: int | None = None
    round_time_s: tuple[float, ...] | None = None
    # Rounds per host round trip (`Engine.steps`): commits come back every this many rounds, a
    # finished row's slot idles until then and is refilled after; 1 = every round (serving
    # latency), more for throughput (offline generation).
    rounds_per_sync: int = 1
    buckets: Sequence[int] | str = ()

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.rounds_per_sync < 1:
            raise ValueError(f"rounds_per_sync must be >= 1, got {self.rounds_per_sync}")
        self._buckets = Buckets.make(self.slots, self.buckets, self.round_time_s)

    def _batch(self, requests: Sequence[Request], key, capacity: int | None) -> decoding.Batch:
        """`decoding.make_batch` of these requests (padding, per-request keys, and by default the
        capacity the longest prompt needs, rounded up to ``pad_multiple``)."""
        return decoding.make_batch([r.prompt for r in requests], self.engine.config, key,
                                   request_ids=[r.id for r in requests], pad_multiple=self.pad_multiple,
                                   capacity=capacity)

    def _context_length(self) -> int | None:
        """The target's context length (``config.max_position``), or None for a target without one."""
        return getattr(getattr(self.engine.target, "config", None), "max_position", None)

    def _check_prompt_fits_context(self, requests: Sequence[Request]) -> None:
        """ValueError naming the first request whose prompt alone fills the target's context (no
        position is left for a new token): the prompt is too long, whatever max_new_tokens is."""
        context = self._context_length()
        if context is None:
            return
        for r in requests:
            if len(r.prompt) >= context:
                raise ValueError(f"request {r.id}: its prompt is too long: {len(r.prompt)} tokens, the target's "
                                 f"context length is {context} (no position is left for a new token); shorten it "
                                 f"to at most {context - 1} tokens")

    def _check(self, requests: Sequence[Request], key) -> int:
        """Every request checked against the engine (ids, context length, capacity) in one host
        pass, before anything runs; the error names the request. Returns the capacity."""
        self._check_prompt_fits_context(requests)
        batch = self._batch(requests, key, self.capacity)
        try:
            self.engine.check(batch)
        except ValueError:
            for r in requests:          # which one: check them one by one (only on the error path)
                try:
                    self.engine.check(self._batch([r], key, batch.capacity))
                except ValueError as e:
                    raise type(e)(f"request {r.id}: {e}") from None
            raise
        return batch.capacity

    def warmup(self, sampling: sampling_lib.SamplingConfig, requests: Sequence[Request], key) -> None:
        """Compile the refill of every padded prompt width the requests need and one round at
        every batch size (with adaptive gamma, one round of every draft length), and the moves
        between sizes, on throw-away states (so `run`'s times hold no compilation)."""
        capacity = self._check(requests, key)
        widths = {}
        for r in requests:
            widths.setdefault(-(-len(r.prompt) // self.pad_multiple), r)
        buckets = self._buckets
        for size in buckets.sizes:
            state = self.engine.empty_state(self.params, size, capacity, buckets.times(size), key=key)
            for r in widths.values():
                state = self.engine.refill(self.params, state, 0, self._batch([r], key, capacity))
            if self.rounds_per_sync == 1:
                self.engine.precompile(self.params, sampling, state)
            state = jax.block_until_ready(self._advance(sampling, state, self.params)[0])
            for other in buckets.sizes:
                if other != size:
                    jax.block_until_ready(self.engine.resize(state, [0] + [None] * (other - 1), buckets.times(other)))

    def _advance(self, sampling, state, params):
        """`rounds_per_sync` rounds: (state, commits with a leading round axis, on the host)."""
        if self.rounds_per_sync == 1:
            state, commit = self.engine.step(params, sampling, state)
            return state, jax.tree.map(lambda x: np.asarray(x)[None], jax.device_get(commit))
        state, commits = self.engine.steps(params, sampling, state, self.rounds_per_sync)
        return state, jax.device_get(commits)

    def run(self, requests: Sequence[Request], sampling: sampling_lib.SamplingConfig, key, *,
            clock: str = "virtual", warmup: bool = True,
            on_finish: Callable[[RequestResult], None] | None = None,
            draft_update: Callable[[Request, RequestResult], object] | None = None) -> ServeOutput:
        """Serve every request (FIFO by arrival, ties in the order given) and return their results in id order
        and the workload's summary (`summarize`); ``on_finish`` is called with each result as its
        request finishes (progress logs). ``draft_update(request, result)``, called as each request
        finishes, returns new draft params for the rounds after it (None: keep them): a drafter that
        learns from earlier requests (`specjax.drafters.SuffixCache`: the finished request joins its
        corpus). The params are arguments of every round, so nothing recompiles."""
        if not requests:
            raise ValueError("no requests given")
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique (each one's key is folded from it)")
        capacity = self._check(requests, key)           # every request, before anything runs
        engine, params = self.engine, self.params
        max_rounds = engine.config.max_rounds       # a request's safety bound, as in `Engine.run`
        if warmup:
            self.warmup(sampling, requests, key)

        queue = collections.deque(sorted(requests, key=lambda r: r.arrival_s))     # stable: ties as given
        buckets = self._buckets
        state = engine.empty_state(params, buckets.sizes[0], capacity, buckets.times(buckets.sizes[0]), key=key)
        jax.block_until_ready(state)
        occupant: list[dict | None] = [None] * buckets.sizes[0]
        results, steps, prefill_s, size_rounds = {}, [], 0.0, collections.Counter()
        resizes, resize_s = 0, 0.0
        clk = _Clock(clock)
        while queue or any(o is not None for o in occupant):
            # The batch size the busy rows and the arrived requests need (`Buckets`).
            if len(buckets.sizes) > 1:
                t = clk.now()
                waiting = sum(1 for r in queue if r.arrival_s <= t)
                before = len(occupant)
                state, occupant = buckets.fit(engine, state, occupant, waiting)
                if len(occupant) != before:
                    jax.block_until_ready(state)
                    resizes += 1
                    resize_s += clk.now() - t
            # Admit every arrived request into a free slot (FIFO).
            for slot in range(len(occupant)):
                if occupant[slot] is None and queue and queue[0].arrival_s <= clk.now():
                    r = queue.popleft()
                    t = clk.now()
                    state = jax.block_until_ready(engine.refill(params, state, slot, self._batch([r], key, capacity)))
                    prefill_s += clk.now() - t
                    occupant[slot] = {"request": r, "admitted": t, "tokens": [], "first": None, "rounds": 0}
            active = [s for s in range(len(occupant)) if occupant[s] is not None]
            if not active:
                clk.wait_until(queue[0].arrival_s)      # nothing to do until the next arrival
                continue
            state, c = self._advance(sampling, state, params)
            size_rounds[len(occupant)] += c.n_B.shape[0]
            t = clk.now()
            finished, live = [], active
            for i in range(c.n_B.shape[0]):         # the rounds of this call, in order
                if not live:
                    break
                steps.append((t, len(live)))
                still = []
                for s in live:
                    o = occupant[s]
                    n = int(c.n_B[i, s])
                    if n:
                        o["tokens"].extend(int(x) for x in c.tokens_BC[i, s, :n])
                        if o["first"] is None:
                            o["first"] = t
                    o["rounds"] += 1
                    if bool(c.done_B[i, s]) or (max_rounds is not None and o["rounds"] >= max_rounds):
                        finished.append(s)
                    else:
                        still.append(s)
                live = still
            if finished:
                status_B, m = jax.device_get((state.status_B, state.metrics))
                for s in finished:
                    o, r = occupant[s], occupant[s]["request"]
                    counters = row_counters(m, s)
                    results[r.id] = RequestResult(
                        id=r.id, prompt_tokens=len(r.prompt), tokens=o["tokens"],
                        status=decoding.STATUS_NAMES[int(status_B[s])], slot=s, arrival_s=r.arrival_s,
                        admitted_s=o["admitted"], first_token_s=o["first"] if o["first"] is not None else float("nan"),
                        finished_s=t, counters=counters)
                    occupant[s] = None
                    if on_finish is not None:
                        on_finish(results[r.id])
                    if draft_update is not None:
                        new = draft_update(r, results[r.id])
                        if new is not None:
                            params = params.replace(draft=new)
        gamma_rounds = np.asarray(jax.device_get(state.metrics.gamma_rounds_Z))
        ordered = [results[i] for i in sorted(results)]
        summary = summarize(ordered, steps, self.slots, gamma_rounds, prefill_s)
        summary.update(rounds_per_size={int(b): int(n) for b, n in sorted(size_rounds.items())}, resizes=resizes,
                       resize_s=resize_s)
        return ServeOutput(results=ordered, summary=summary, steps=steps)


def generate_offline(engine: decoding.Engine, params: decoding.EngineParams, prompts: Sequence[Sequence[int]],
                     sampling: sampling_lib.SamplingConfig, key, *, request_ids: Sequence[int], slots: int,
                     pad_multiple: int = 64, rounds_per_sync: int = 16,
                     on_finish: Callable[[RequestResult], None] | None = None,
                     on_group: Callable[[dict], None] | None = None) -> dict[int, list[int]]:
    """Every prompt generated through slot-refilling schedulers (offline: all requests arrive
    at once), one per padded prompt width, so a few long prompts do not size every row's cache:
    a group of width W gets ``slots * 2 * pad_multiple // max(W, 2 * pad_multiple)`` slots (at
    least 1, at most its requests), its own cache capacity, and `rounds_per_sync` rounds per host
    round trip. Request ``request_ids[i]`` samples with ``fold_in(key, id)``, so what it gets
    does not depend on the grouping. Returns {id: generated tokens}; ``on_group`` gets each
    group's ``{"rows", "width", "requests", "new_tokens", "seconds"}``."""
    if len(request_ids) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(request_ids)} request ids")
    groups: dict[int, list[int]] = {}
    for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):
        groups.setdefault(-(-len(prompts[i]) // pad_multiple) * pad_multiple, []).append(i)
    tokens: dict[int, list[int]] = {}
    for width, idx in sorted(groups.items()):
        rows = max(1, min(slots, slots * 2 * pad_multiple // max(width, 2 * pad_multiple), len(idx)))
        t0 = time.perf_counter()
        sched = Scheduler(engine, params, slots=rows, pad_multiple=pad_multiple, rounds_per_sync=rounds_per_sync)
        out = sched.run([Request(id=request_ids[i], prompt=prompts[i]) for i in idx], sampling, key,
                        warmup=False, on_finish=on_finish)
        new = {res.id: res.tokens for res in out.results}
        tokens.update(new)
        if on_group is not None:
            on_group({"rows": rows, "width": width, "requests": len(idx),
                      "new_tokens": sum(len(t) for t in new.values()), "seconds": time.perf_counter() - t0})
    return tokens
