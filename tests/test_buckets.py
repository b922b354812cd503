"""Batch sizes for the schedulers (`serving.Buckets`, `Engine.resize`) and load-aware gamma.

1. `Engine.resize` moves rows whole: a moved row's tokens, lengths, caches (both layouts),
   key, counters and automaton state are the old row's; new rows are empty and done; the
   batch-wide entries carry over, the policy's round times become the new size's; bad row
   lists are refused by name.
2. A scheduler that resizes its batch as requests come and go gives each request exactly what
   it gets alone (tokens, status, counters): greedy and T = 1 on the tabular toy, greedy on a
   tiny Llama pair with real caches, finished rows refilled while others run (its greedy
   margins are far above batch-shape rounding, tests/_multiprocess_common.py).
3. Adaptive gamma follows the batch size: with round times that make speculation free at one
   row and ruinous at more, rounds at one row draft and rounds at more run gamma 0 (up to the
   policy's probes), and greedy output is still the target's.
4. The policy prices a round by the active rows' own acceptance (`row_alphas`, `choose`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, drafters, models, sampling, serving
from specjax.decoding import adaptive

from _multiprocess_common import tiny_pair
from _toy import TabularModel, random_table

V, MAX_NEW, PAD, CAPACITY, KEY = 8, 10, 8, 32, jax.random.key(5)
GREEDY, T1 = sampling.SamplingConfig.make(0.0), sampling.SamplingConfig.make(temperature=1.0, top_p=0.9)
PROMPTS = [[5], [1, 2, 3, 4], [7, 0, 3, 3, 1, 6], [2, 2], [4, 4, 1], [6], [3, 1, 4, 1, 5], [0, 7]]
# five at once (the batch grows to 4 and drains back to 1), three more much later (it grows again)
ARRIVALS = [0.0] * 5 + [1000.0] * 3


@functools.lru_cache(maxsize=None)
def _toy(gamma=3, adaptive_gammas=None):
    table = random_table(jax.random.key(1), V, peak=1.5)
    draft = random_table(jax.random.key(2), V, peak=1.5)
    g = adaptive.AdaptiveGamma(gammas=adaptive_gammas) if adaptive_gammas else gamma
    config = decoding.GenerationConfig(MAX_NEW, gamma=g, eos_ids=(3,))
    return (decoding.Engine(TabularModel(V), drafters.ModelDrafter(TabularModel(V)), config),
            decoding.EngineParams(target=table, draft=draft))


@functools.lru_cache(maxsize=None)
def _llama():
    target, tp, small, sp = tiny_pair()
    small = models.Llama(small.config.replace(scan_layers=True))       # the draft's caches stacked
    sp = jax.tree.map(lambda x: 4 * x, small.init_params(jax.random.key(1)))
    return (decoding.Engine(target, drafters.ModelDrafter(small), decoding.GenerationConfig(max_new_tokens=12, gamma=3)),
            decoding.EngineParams(target=tp, draft=sp))


def _requests(prompts, arrivals):
    return [serving.Request(id=100 + i, prompt=p, arrival_s=a) for i, (p, a) in enumerate(zip(prompts, arrivals))]


def _alone(engine, params, samp, request, capacity):
    batch = decoding.make_batch([request.prompt], engine.config, KEY, request_ids=[request.id], pad_multiple=PAD,
                                capacity=capacity)
    out = jax.device_get(engine.run(params, samp, batch))
    m = out.metrics
    return out.generated()[0], out.statuses()[0], {"target_passes": int(m.rounds_B[0]), "proposed": int(m.proposed_B[0]),
                                                  "accepted": int(m.accepted_B[0]), "committed": int(m.committed_B[0])}


# ----------------------------------------------------------------------------- resize

def _row(tree, axis_of, i):
    return jax.tree.map(lambda x: np.take(np.asarray(x), i, axis=axis_of(x)), tree)


def test_resize_moves_rows_whole_and_refuses_bad_row_lists():
    """2 rows to 4, the rows swapped (old rows 1 and 0 to 0 and 1) and two empty rows: the
    sizes, capacity and padding of the real-cache scheduler test below, whose programs these are."""
    engine, params = _llama()
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6]]
    state = engine.empty_state(params, 2, 48, key=KEY)
    for s, p in enumerate(prompts):
        state = engine.refill(params, state, s, decoding.make_batch([p], engine.config, KEY, request_ids=[s],
                                                                    pad_multiple=PAD, capacity=48))
    for _ in range(2):
        state, _ = engine.step(params, GREEDY, state)
    old = jax.tree.map(jnp.copy, state)             # the step below donates what it is given
    new = engine.resize(state, [1, 0, None, -1])
    a = lambda x: np.asarray(x)                    # noqa: E731
    assert new.tokens_BS.shape[0] == 4
    for n, o in ((0, 1), (1, 0)):
        assert np.array_equal(a(new.tokens_BS)[n], a(old.tokens_BS)[o]) and a(new.lengths_B)[n] == a(old.lengths_B)[o]
        assert not a(new.done_B)[n] and a(new.metrics.rounds_B)[n] == a(old.metrics.rounds_B)[o]
        assert np.array_equal(a(jax.random.key_data(new.key_B))[n], a(jax.random.key_data(old.key_B))[o])
        # target caches per layer (batch axis 0), draft caches stacked (batch axis 1)
        assert new.target_cache.per_layer and not new.draft_state.cache.per_layer
        for x, y in zip(new.target_cache.k, old.target_cache.k):
            assert np.array_equal(a(x)[n], a(y)[o])
        assert np.array_equal(a(new.draft_state.cache.k)[:, n], a(old.draft_state.cache.k)[:, o])
    assert a(new.done_B)[2] and a(new.done_B)[3]
    assert int(new.round) == int(old.round)
    assert np.array_equal(a(new.metrics.gamma_rounds_Z), a(old.metrics.gamma_rounds_Z))
    # the moved rows go on as they would have: one more round, the same tokens
    cont_old = engine.step(params, GREEDY, jax.tree.map(jnp.copy, old))[0]
    cont_new = engine.step(params, GREEDY, new)[0]
    for n, o in ((0, 1), (1, 0)):
        assert np.array_equal(a(cont_new.tokens_BS)[n], a(cont_old.tokens_BS)[o])
        assert a(cont_new.lengths_B)[n] == a(cont_old.lengths_B)[o] > a(old.lengths_B)[o]
    state = old
    for rows, match in (([0, 0], "distinct"), ([2], "distinct"), ([], "at least one row"), ([-2], "distinct")):
        with pytest.raises(ValueError, match=match):
            engine.resize(state, rows)


def test_resize_sets_the_new_sizes_round_times():
    """1 row to 4 (the adaptive scheduler test's first state and growth: the same programs)."""
    engine, params = _toy(adaptive_gammas=(0, 1, 3))
    state = engine.empty_state(params, 1, CAPACITY, round_time_s=(1.0, 2.0, 3.0), key=KEY)
    big = engine.resize(state, [0, None, None, None], round_time_s=(1.0, 1.1, 1.2))
    assert np.allclose(np.asarray(big.policy.round_time_RZ), [[1.0, 1.1, 1.2]])
    assert np.array_equal(np.asarray(big.policy.alpha_R), np.asarray(state.policy.alpha_R))


# ----------------------------------------------------------------------------- Buckets

def test_buckets_sizes_and_their_errors():
    assert serving.Buckets.make(16, "powers").sizes == (1, 2, 4, 8, 16)
    assert serving.Buckets.make(6, "powers").sizes == (1, 2, 4, 6)
    assert serving.Buckets.make(4, ()).sizes == (4,)
    assert serving.Buckets.make(4, (1, 4)).sizes == (1, 4)
    b = serving.Buckets.make(8, (1, 4), round_time_s={1: [1.0], 4: [2.0], 8: [3.0]})
    assert [b.size_for(n) for n in (0, 1, 2, 4, 5, 9)] == [1, 1, 4, 4, 8, 8] and b.times(4) == (2.0,)
    assert serving.Buckets.make(4, "powers", round_time_s=[1.0, 2.0]).times(2) == (1.0, 2.0)
    for bad, match in (((0, 2), "distinct sorted"), ((2, 1), "distinct sorted"), ((1, 9), r"\[1, slots=4\]"),
                       ("all", "'powers'")):
        with pytest.raises(ValueError, match=match):
            serving.Buckets.make(4, bad)
    with pytest.raises(ValueError, match=r"no times for batch size\(s\) \[2\]"):
        serving.Buckets.make(4, "powers", round_time_s={1: [1.0], 4: [1.0]})


# ----------------------------------------------------------------------------- schedulers

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_resizing_scheduler_gives_each_request_what_it_gets_alone(temperature):
    """Batch sizes 1 and 4 (two sizes: every resize and refill path, fewer programs than the
    powers of 2, whose sizes test_buckets_sizes_and_their_errors checks): grown, drained, grown again."""
    engine, params = _toy()
    samp = GREEDY if temperature == 0 else T1
    requests = _requests(PROMPTS, ARRIVALS)
    out = serving.Scheduler(engine, params, slots=4, pad_multiple=PAD, capacity=CAPACITY, buckets=(1, 4)).run(
        requests, samp, KEY, warmup=False)
    s = out.summary
    assert set(s["rounds_per_size"]) == {1, 4} and s["resizes"] >= 3, s
    assert sorted(r.id for r in out.results) == [r.id for r in requests]
    for req, r in zip(requests, out.results):
        tokens, status, counters = _alone(engine, params, samp, req, CAPACITY)
        assert r.tokens == tokens and r.status == status, req.id
        assert {k: r.counters[k] for k in counters} == counters, req.id


def test_a_resizing_scheduler_on_real_caches():
    """Real caches (target per layer, draft stacked: both row layouts of `Engine.refill` and
    `Engine.resize`), batch sizes 2 and 4: five requests at once through 4 rows (the fifth
    refills a finished request's row: a refilled row's caches hold only its own prompt and
    tokens), the batch shrinks to 2 rows as they drain, two more much later (refilling finished
    rows). Every request gets the tokens, status and counters it gets alone."""
    engine, params = _llama()
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 96, n)] for n in (3, 9, 5, 12, 1, 6, 4)]
    requests = _requests(prompts, [0.0] * 5 + [1000.0] * 2)
    out = serving.Scheduler(engine, params, slots=4, pad_multiple=PAD, capacity=48, buckets=(2,)).run(
        requests, GREEDY, KEY, warmup=False)
    assert out.summary["resizes"] >= 2 and set(out.summary["rounds_per_size"]) == {2, 4}
    # the fifth waited for a row to finish
    assert min(r.finished_s for r in out.results[:4]) <= out.results[4].admitted_s
    for req, r in zip(requests, out.results):
        tokens, status, counters = _alone(engine, params, GREEDY, req, 48)
        assert r.tokens == tokens and r.status == status, req.id
        assert {k: r.counters[k] for k in counters} == counters, req.id


def test_adaptive_gamma_follows_the_batch_size():
    """Batch sizes 1 and 4. Round times: free speculation at one row, 100x a plain round at 4
    rows. Rounds at one row then run the largest gamma; rounds at more rows gamma 0, except the
    policy's probes (one every `probe_every` rounds at gamma 0, at the smallest positive gamma)."""
    gammas = (0, 1, 3)
    engine, params = _toy(adaptive_gammas=gammas)
    times = {1: [1.0, 1.0, 1.0], 4: [1.0, 100.0, 100.0]}
    requests = _requests(PROMPTS, ARRIVALS)
    out = serving.Scheduler(engine, params, slots=4, pad_multiple=PAD, capacity=CAPACITY, buckets=(1, 4),
                            round_time_s=times).run(requests, GREEDY, KEY, warmup=False)
    s = out.summary
    at_one = s["rounds_per_size"].get(1, 0)
    at_more = s["engine_rounds"] - at_one
    assert at_one > 0 and at_more > 0, s
    g0, g1, g3 = s["rounds_per_gamma"]
    assert g3 == at_one, s                     # every one-row round drafts 3
    probes = -(-at_more // engine.config.gamma.probe_every) + 1
    assert g1 <= probes and g0 >= at_more - probes, s
    for req, r in zip(requests, out.results):
        assert r.tokens == _alone(engine, params, GREEDY, req, CAPACITY)[0], req.id


# ----------------------------------------------------------------------------- the policy

def test_rows_are_priced_by_their_own_acceptance():
    policy = adaptive.AdaptiveGamma(gammas=(0, 1), hysteresis=0.0, prior_positions=8.0)
    state = adaptive.init_policy(policy, [[1.0, 1.5]]).replace(alpha_R=jnp.asarray([0.5]))
    # a fresh row is its regime's estimate; a row with 100 tested positions is mostly its own
    a_B = adaptive.row_alphas(policy, state, jnp.asarray([0, 90, 5]), jnp.asarray([0, 100, 50]), jnp.zeros(3, jnp.int32))
    assert np.allclose(np.asarray(a_B), [0.5, (90 + 4) / 108, (5 + 4) / 58])
    # gamma 1 costs 1.5 rounds: worth it only where the rows commit > 1.5 tokens each on average
    # (jitted: one program for every call; op by op, each operation compiles its own)
    choose_jit = jax.jit(lambda a, active: adaptive.choose(policy, state, 0, a, active)[0])
    choose = lambda a, active: int(choose_jit(jnp.asarray(a), jnp.asarray(active)))  # noqa: E731
    assert choose([0.9, 0.1], [True, False]) == 1          # E = 1.9 at gamma 1: 1.5 / 1.9 < 1
    assert choose([0.9, 0.1], [False, True]) == 0          # E = 1.1: 1.5 / 1.1 > 1
    assert choose([0.9, 0.3], [True, True]) == 1           # 1.5 / 3.2 < 1 / 2
    assert choose([0.9, 0.05], [True, True]) == 0          # 1.5 / 2.95 > 1 / 2
    # no active row: priced as without row estimates (the regime's)
    assert choose([0.9, 0.9], [False, False]) == int(adaptive.choose(policy, state, 0)[0]) == 0


def test_the_estimate_forgets_per_tested_position_not_per_round():
    """`adaptive.update`'s estimate is the discounted mean of every tested position (a position
    tested n positions ago weighs (1 - 1/window)^n, a round's positions alike, the prior
    `initial_weight` positions at `initial_alpha`), checked against that sum written out over 200
    random rounds of 0-12 positions (seed 0); so a one-position round moves a settled estimate by
    at most ~1/window, where the old per-round average moved it by 0.3 of the round's mean."""
    policy = adaptive.AdaptiveGamma(gammas=(0, 1), window=32.0, initial_weight=4.0, initial_alpha=0.5)
    state = adaptive.init_policy(policy, [[1.0, 1.5]])
    update = jax.jit(lambda s, tot, n: adaptive.update(policy, s, jnp.int32(1), jnp.zeros((), bool), tot, n))
    rng = np.random.default_rng(0)
    lam = 1.0 - 1.0 / 32.0
    weights, values = [4.0], [0.5]                  # every position so far (and the prior), current weights
    for _ in range(200):
        n = int(rng.integers(0, 13))
        x = rng.uniform(0.0, 1.0, n) * (rng.uniform() < 0.8)
        state = update(state, jnp.asarray([x.sum()], jnp.float32), jnp.asarray([n]))
        weights = [w * lam ** n for w in weights] + [1.0] * n
        values += list(x)
        want = np.dot(weights, values) / np.sum(weights)
        np.testing.assert_allclose(float(state.alpha_R[0]), want, rtol=2e-5)
        np.testing.assert_allclose(float(state.weight_R[0]), np.sum(weights), rtol=2e-5)
    settled = float(state.alpha_R[0])
    one = update(state, jnp.asarray([0.0]), jnp.asarray([1]))
    many = update(state, jnp.asarray([0.0]), jnp.asarray([48]))
    assert 0 < settled - float(one.alpha_R[0]) <= settled / 32 * 1.01
    assert settled - float(many.alpha_R[0]) > 0.7 * settled
    idle = update(state, jnp.asarray([0.0]), jnp.asarray([0]))          # gamma 0: nothing tested, nothing moves
    assert float(idle.alpha_R[0]) == settled and float(idle.weight_R[0]) == float(state.weight_R[0])
    for bad in (dict(window=0.5), dict(initial_weight=0.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            adaptive.AdaptiveGamma(gammas=(0, 1), **bad)


def test_gamma_arrivals_have_the_rate_and_burstiness_asked_for():
    """20,000 gaps at rate 4/s: mean 0.25 s, and coefficient of variation 1/sqrt(shape) (2 at
    shape 0.25, 1 = Poisson at shape 1); tolerances ~6 standard errors, seed 0."""
    for shape, cv in ((0.25, 2.0), (1.0, 1.0)):
        gaps = np.diff(np.concatenate([[0.0], serving.gamma_arrivals(20_000, 4.0, shape, seed=0)]))
        assert abs(gaps.mean() - 0.25) < 0.25 * 6 * cv / np.sqrt(20_000)
        assert abs(gaps.std() / gaps.mean() - cv) < 0.1 * cv
    assert np.all(np.diff(serving.gamma_arrivals(100, 1.0, 0.25, seed=1)) >= 0)
    for bad in (dict(rate_per_s=0.0, burstiness=1.0), dict(rate_per_s=1.0, burstiness=0.0)):
        with pytest.raises(ValueError, match="gamma_arrivals needs"):
            serving.gamma_arrivals(10, seed=0, **bad)
