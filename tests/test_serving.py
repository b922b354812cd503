"""The slot-refilling scheduler (`specjax.serving.Scheduler`).

1. A refilled slot's output equals the request run alone (`Engine.run` on a one-row batch with
   the request's own key): greedy and temperature 1 (top-p 0.9), target-only and speculative
   (a model draft, gamma 3; n-gram), on the tabular toy (exact arithmetic, EOS so rows end at
   different rounds). On a tiny random Llama pair whose KV caches are real (target in the
   per-layer layout, draft stacked: both row-scatter paths of `Engine.refill`), a finished row
   refilled while the others run: tests/test_buckets.py::test_a_resizing_scheduler_on_real_caches.
2. A request's counters are its own: target passes, proposals, accepted and committed tokens
   equal those of its solo run.
3. No request is lost or duplicated, and every result is its own, under random Poisson
   arrival orders (hypothesis over seeds, rates and slot counts; tabular toy, one compiled
   program per slot count).
4. Times are ordered (arrival <= admitted <= first token <= finished), the queue is FIFO, the
   virtual clock skips idle gaps, and bad requests are refused before anything runs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specjax import decoding, drafters, models, sampling, serving

from _toy import TabularModel, random_table

V = 8
MAX_NEW = 10
GREEDY = sampling.SamplingConfig.make(0.0)
T1 = sampling.SamplingConfig.make(temperature=1.0, top_p=0.9)
KEY = jax.random.key(11)
PROMPTS = [[5], [1, 2, 3, 4], [7, 0, 3, 3, 1, 6], [2, 2], [4, 4, 1], [6], [3, 1, 4, 1, 5], [0, 7]]
PAD = 8                   # prompts pad to width 8: one compiled refill
CAPACITY = 32


@functools.lru_cache(maxsize=None)
def _toy(kind: str):
    """(engine, params): target-only, a model draft (gamma 3) or n-gram (gamma 2), with an EOS."""
    target = TabularModel(V)
    table = random_table(jax.random.key(1), V, peak=1.5)
    draft = random_table(jax.random.key(2), V, peak=1.5)
    if kind == "target":
        return decoding.Engine(target, None, decoding.GenerationConfig(MAX_NEW, gamma=0, eos_ids=(3,))), \
            decoding.EngineParams(target=table)
    if kind == "ngram":
        return decoding.Engine(target, drafters.NGramDrafter(V), decoding.GenerationConfig(MAX_NEW, gamma=2,
                                                                                           eos_ids=(3,))), \
            decoding.EngineParams(target=table)
    return decoding.Engine(target, drafters.ModelDrafter(TabularModel(V)),
                           decoding.GenerationConfig(MAX_NEW, gamma=3, eos_ids=(3,))), \
        decoding.EngineParams(target=table, draft=draft)


def _requests(prompts, arrivals=None):
    arrivals = [0.0] * len(prompts) if arrivals is None else arrivals
    return [serving.Request(id=100 + i, prompt=p, arrival_s=float(a)) for i, (p, a) in enumerate(zip(prompts, arrivals))]


@functools.lru_cache(maxsize=None)
def _alone(kind: str, temperature: float, i: int):
    """(tokens, status, counters) of request 100 + i decoded alone by `Engine.run`."""
    engine, params = _toy(kind)
    samp = GREEDY if temperature == 0 else T1
    batch = decoding.make_batch([PROMPTS[i]], engine.config, KEY, request_ids=[100 + i], pad_multiple=PAD,
                                capacity=CAPACITY)
    out = jax.device_get(engine.run(params, samp, batch))
    m = out.metrics
    counters = {"target_passes": int(m.rounds_B[0]), "proposed": int(m.proposed_B[0]),
                "accepted": int(m.accepted_B[0]), "committed": int(m.committed_B[0])}
    return out.generated()[0], out.statuses()[0], counters


def _check_against_alone(out, kind, temperature):
    for r in out.results:
        tokens, status, counters = _alone(kind, temperature, r.id - 100)
        assert r.tokens == tokens, (r.id, r.slot)
        assert r.status == status
        for name, want in counters.items():
            assert r.counters[name] == want, (r.id, name)
        assert r.counters["committed"] == len(r.tokens)


@pytest.mark.parametrize("kind, temperature", [("target", 0.0), ("draft", 0.0), ("draft", 1.0), ("ngram", 1.0)])
def test_refilled_slots_equal_requests_alone(kind, temperature):
    engine, params = _toy(kind)
    sched = serving.Scheduler(engine, params, slots=3, pad_multiple=PAD, capacity=CAPACITY)
    out = sched.run(_requests(PROMPTS), GREEDY if temperature == 0 else T1, KEY, warmup=False)
    assert [r.id for r in out.results] == [100 + i for i in range(len(PROMPTS))]
    # 8 requests through 3 slots: most rows were refilled at least once, in every slot.
    assert {r.slot for r in out.results} == {0, 1, 2}
    assert len({r.status for r in out.results}) == 2        # EOS and max_new_tokens both occur
    _check_against_alone(out, kind, temperature)
    s = out.summary
    assert s["tokens"] == sum(len(r.tokens) for r in out.results)
    assert s["row_rounds"] <= s["engine_rounds"] * 3
    assert s["requests"] == len(PROMPTS)


@pytest.mark.parametrize("kind, temperature, rounds_per_sync", [("target", 0.0, 2), ("draft", 1.0, 5)])
def test_several_rounds_per_sync_give_each_request_what_it_gets_alone(kind, temperature, rounds_per_sync):
    """`Scheduler(rounds_per_sync=n)` runs n rounds per host round trip (`Engine.steps`, one
    program per n): a finished row's slot idles until the call ends and is refilled after, and
    every request still gets exactly the tokens, status and counters it gets alone (n = 2
    target-only greedy, n = 5 speculative at T = 1)."""
    engine, params = _toy(kind)
    sched = serving.Scheduler(engine, params, slots=3, pad_multiple=PAD, capacity=CAPACITY,
                              rounds_per_sync=rounds_per_sync)
    out = sched.run(_requests(PROMPTS), GREEDY if temperature == 0 else T1, KEY, warmup=True)
    assert [r.id for r in out.results] == [100 + i for i in range(len(PROMPTS))]
    assert {r.slot for r in out.results} == {0, 1, 2}
    _check_against_alone(out, kind, temperature)
    with pytest.raises(ValueError, match="rounds_per_sync"):
        serving.Scheduler(engine, params, slots=3, rounds_per_sync=0)


# ----------------------------------------------------------------------------- random arrivals

@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), rate=st.sampled_from([0.5, 5.0, 500.0]), slots=st.sampled_from([1, 3]),
       temperature=st.sampled_from([0.0, 1.0]))
def test_random_arrivals_lose_and_duplicate_nothing(seed, rate, slots, temperature):
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(PROMPTS))
    arrivals = serving.poisson_arrivals(len(PROMPTS), rate, seed)
    requests = [serving.Request(id=100 + int(i), prompt=PROMPTS[int(i)], arrival_s=float(a))
                for i, a in zip(order, arrivals)]
    engine, params = _toy("draft")
    out = serving.Scheduler(engine, params, slots=slots, pad_multiple=PAD, capacity=CAPACITY).run(
        requests, GREEDY if temperature == 0 else T1, KEY, warmup=False)
    assert sorted(r.id for r in out.results) == sorted(r.id for r in requests)
    _check_against_alone(out, "draft", temperature)
    for r in out.results:
        assert r.arrival_s <= r.admitted_s <= r.first_token_s <= r.finished_s
    # FIFO: requests are admitted in arrival order.
    by_arrival = sorted(out.results, key=lambda r: (r.arrival_s, r.id))
    admitted = [r.admitted_s for r in by_arrival]
    assert admitted == sorted(admitted)
    assert all(1 <= a <= slots for _, a in out.steps)


def test_virtual_clock_skips_idle_gaps():
    engine, params = _toy("target")
    requests = _requests(PROMPTS[:3], arrivals=[0.0, 1000.0, 2000.0])
    # 3 slots: the programs of test_refilled_slots_equal_requests_alone[target-0.0]
    out = serving.Scheduler(engine, params, slots=3, pad_multiple=PAD, capacity=CAPACITY).run(
        requests, GREEDY, KEY, warmup=True)     # compiled before the clock starts
    for r in out.results:
        assert r.queue_delay_s < 5.0            # each arrives to an empty server
        assert r.latency_s < 5.0
    assert out.summary["makespan_s"] > 2000.0   # the span of the workload, idle included
    assert out.summary["mean_active_slots"] == 1.0


def test_full_slots_queue_requests():
    """One slot, all arriving at once: each waits for the one before it (queue delay = the
    previous one's finish time). (The model draft at one slot: programs the random-arrival test compiled.)"""
    engine, params = _toy("draft")
    out = serving.Scheduler(engine, params, slots=1, pad_multiple=PAD, capacity=CAPACITY).run(
        _requests(PROMPTS[:4]), GREEDY, KEY, warmup=False)
    res = out.results
    assert res[0].queue_delay_s < 1.0
    for prev, nxt in zip(res, res[1:]):
        assert nxt.admitted_s >= prev.finished_s              # one slot: strictly one after another
        assert nxt.queue_delay_s >= prev.latency_s - 1e-9      # all arrive at 0: waits for the one before
    assert {r.slot for r in res} == {0}


def test_bad_requests_are_refused_before_anything_runs():
    engine, params = _toy("draft")
    sched = serving.Scheduler(engine, params, slots=2, pad_multiple=PAD, capacity=16)
    too_long = _requests([PROMPTS[0], [1] * 8])
    with pytest.raises(models.CacheCapacityError, match="request 101"):
        sched.run(too_long, GREEDY, KEY, warmup=False)
    with pytest.raises(ValueError, match="outside"):
        sched.run(_requests([[1, 99]]), GREEDY, KEY, warmup=False)
    with pytest.raises(ValueError, match="unique"):
        sched.run([serving.Request(1, [1]), serving.Request(1, [2])], GREEDY, KEY, warmup=False)
    with pytest.raises(ValueError, match="empty prompt"):
        serving.Request(1, [])
    with pytest.raises(ValueError, match="arrival_s"):
        serving.Request(1, [1], arrival_s=float("nan"))
    with pytest.raises(ValueError, match="slots"):
        serving.Scheduler(engine, params, slots=0)
    state = engine.empty_state(params, 3, CAPACITY)        # the 3-slot state of the tests above
    one = decoding.make_batch([[1, 2]], engine.config, KEY, capacity=16)
    with pytest.raises(ValueError, match="capacity 16 differs"):
        engine.refill(params, state, 0, one)
    with pytest.raises(ValueError, match="slot 3 outside"):
        engine.refill(params, state, 3, decoding.make_batch([[1, 2]], engine.config, KEY, capacity=CAPACITY))


def test_max_rounds_bounds_each_request():
    """`GenerationConfig.max_rounds` bounds a request's rounds in the scheduler as in `Engine.run`
    (the same tokens), and its slot goes to the next request."""
    engine, params = _toy("target")
    engine = dataclasses.replace(engine, config=dataclasses.replace(engine.config, max_rounds=4))
    out = serving.Scheduler(engine, params, slots=2, pad_multiple=PAD, capacity=CAPACITY).run(
        _requests(PROMPTS[:3]), GREEDY, KEY, warmup=False)
    for i, r in enumerate(out.results):
        alone = engine.run(params, GREEDY, decoding.make_batch([PROMPTS[i]], engine.config, KEY, request_ids=[100 + i],
                                                               pad_multiple=PAD, capacity=CAPACITY))
        assert r.tokens == alone.generated()[0] and r.counters["target_passes"] <= 4


def test_legacy_uint32_keys_serve_like_typed_ones():
    """A legacy `jax.random.PRNGKey` works as the scheduler's key (the empty state's placeholder
    keys take its kind) and gives the tokens of `Engine.run` with the same key."""
    engine, params = _toy("draft")
    legacy = jax.random.PRNGKey(11)
    out = serving.Scheduler(engine, params, slots=2, pad_multiple=PAD, capacity=CAPACITY).run(
        _requests(PROMPTS[:3]), T1, legacy, warmup=False)
    for i, r in enumerate(out.results):
        batch = decoding.make_batch([PROMPTS[i]], engine.config, legacy, request_ids=[100 + i], pad_multiple=PAD,
                                    capacity=CAPACITY)
        assert r.tokens == engine.run(params, T1, batch).generated()[0]
