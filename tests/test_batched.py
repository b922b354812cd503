"""Many requests in length-sorted batches (`decoding.plan_batches`, `decoding.generate_batched`):
the plan (sorted, bounded rows, rows cut by the cache budget, every request once) and the
outputs (the same tokens as one whole batch: keys come from request ids, not batch rows)."""

import jax
import numpy as np
import pytest

from specjax import decoding, drafters, sampling

from _toy import TabularModel, random_table

V = 12
LENGTHS = [5, 40, 3, 17, 60, 9, 33, 3]


def _engine(gamma=0, max_new_tokens=6):
    config = decoding.GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma)
    return decoding.Engine(TabularModel(V), drafters.NGramDrafter(V) if gamma else None, config)


def test_plan_sorted_bounded_and_complete():
    engine = _engine()
    plan = decoding.plan_batches(LENGTHS, engine, batch_size=3, pad_multiple=8)
    assert sorted(i for b in plan for i in b) == list(range(len(LENGTHS)))
    assert all(1 <= len(b) <= 3 for b in plan)
    flat = [i for b in plan for i in b]
    # ascending length, ties in index order (indices 2 and 7 both have length 3)
    assert flat == sorted(range(len(LENGTHS)), key=lambda i: (LENGTHS[i], i))
    assert [len(b) for b in plan] == [3, 3, 2]
    unsorted = decoding.plan_batches(LENGTHS, engine, batch_size=3, pad_multiple=8, sort_by_length=False)
    assert unsorted == [[0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="batch_size"):
        decoding.plan_batches(LENGTHS, engine, batch_size=0, pad_multiple=8)


def test_plan_cuts_rows_to_the_cache_budget():
    engine = _engine()
    # the toy cache holds one int32 per slot and row; the longest prompt (60) needs
    # slots_needed(60) = 60 + 6 + 0 + 1 = 67 -> 72 slots at pad 8: 288 bytes a row
    assert decoding.cache_bytes_per_row(engine, 72) == 288
    plan = decoding.plan_batches(LENGTHS, engine, batch_size=4, pad_multiple=8, max_cache_bytes=2 * 288)
    longest = [b for b in plan if 4 in b][0]
    assert len(longest) <= 2
    assert all(len(b) * decoding.cache_bytes_per_row(
        engine, -(-(max(LENGTHS[i] for i in b) + 7) // 8) * 8) <= 2 * 288 or len(b) == 1 for b in plan)
    # a budget below one row still runs every request, one row each where needed
    tiny = decoding.plan_batches(LENGTHS, engine, batch_size=4, pad_multiple=8, max_cache_bytes=1)
    assert [len(b) for b in tiny] == [1] * len(LENGTHS)


@pytest.mark.parametrize("temperature, gamma", [(0.0, 0), (1.0, 0), (1.0, 3)])
def test_outputs_equal_one_whole_batch(temperature, gamma):
    """Every request's tokens and status equal what one batch of all prompts gives (same keys by
    request id); fails if a batch were keyed by row, or results were mapped to the wrong request."""
    engine = _engine(gamma=gamma)
    table = random_table(jax.random.key(1), V)
    params = decoding.EngineParams(target=table, draft=None)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, V, n)] for n in LENGTHS]
    samp = sampling.SamplingConfig.make(temperature=temperature)
    key = jax.random.key(7)
    ids = [100 + 3 * i for i in range(len(prompts))]
    got, reports = {}, []
    for results, report in decoding.generate_batched(engine, params, prompts, samp, key, batch_size=3, pad_multiple=8,
                                                     request_ids=ids):
        got.update((r.index, (r.tokens, r.status)) for r in results)
        reports.append(report)
    whole = engine.run(params, samp, decoding.make_batch(prompts, engine.config, key, request_ids=ids, pad_multiple=8))
    want = dict(enumerate(zip(whole.generated(), whole.statuses())))
    assert got == want
    assert sum(r.new_tokens for r in reports) == sum(len(t) for t, _ in got.values())
    assert sum(r.prompt_tokens for r in reports) == sum(LENGTHS)
    assert [r.rows for r in reports] == [3, 3, 2]
    assert all(r.prefill_s > 0 and r.decode_s > 0 and r.rounds >= 1 for r in reports)


def test_bad_requests_fail_before_running():
    engine = _engine()
    params = decoding.EngineParams(target=random_table(jax.random.key(1), V))
    samp = sampling.SamplingConfig.make(temperature=0.0)
    with pytest.raises(ValueError, match="no prompts"):
        next(decoding.generate_batched(engine, params, [], samp, jax.random.key(0), batch_size=2))
    with pytest.raises(ValueError, match="request ids"):
        next(decoding.generate_batched(engine, params, [[1, 2]], samp, jax.random.key(0), batch_size=2,
                                       request_ids=[1, 2]))
