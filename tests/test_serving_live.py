"""`serving.LiveScheduler` (the engine thread under `specjax serve`) on a tiny random Llama pair.

Requests submitted from several threads while it runs, with their own max_tokens: each gets
the tokens it gets decoded alone (`Engine.run` on its prompt, same cache capacity), cut at its
max_tokens; a request cancelled in the queue or in its slot ends with "cancelled" and its slot
serves the next one; a receiver that raises cancels only its own request; `stop` drains; bad
submissions are refused by name. Greedy, so "decoded alone" is token equality (the pair's
greedy margins are far above rounding, tests/_multiprocess_common.py).
"""
import threading
import time

import jax
import numpy as np
import pytest

from specjax import decoding, drafters, sampling, serving

MAX_NEW = 10


@pytest.fixture(scope="module")
def setup():
    from _multiprocess_common import tiny_pair
    target, tp, small, sp = tiny_pair()
    gen = decoding.GenerationConfig(max_new_tokens=MAX_NEW, gamma=3)
    engine = decoding.Engine(target, drafters.ModelDrafter(small), gen)
    params = decoding.EngineParams(target=tp, draft=sp)
    greedy = sampling.SamplingConfig.make(0.0)
    capacity = gen.slots_needed(64)
    return engine, params, greedy, capacity


def _alone(setup, prompt):
    engine, params, greedy, capacity = setup
    batch = decoding.make_batch([prompt], engine.config, jax.random.key(0), pad_multiple=64, capacity=capacity)
    out = engine.run(params, greedy, batch)
    n = int(np.asarray(out.lengths_B)[0]) - len(prompt)
    return [int(x) for x in np.asarray(out.tokens_BS)[0, len(prompt):len(prompt) + n]]


class Collector:
    def __init__(self):
        self.tokens, self.done, self.event = [], None, threading.Event()

    def __call__(self, ev):
        if ev["type"] == "tokens":
            self.tokens.extend(ev["ids"])
        else:
            self.done = ev
            self.event.set()


@pytest.mark.parametrize("buckets", [(), "powers"])
def test_requests_from_threads_get_their_own_tokens_and_cancel_frees_slots(setup, buckets):
    """With ``buckets`` 'powers' the rows move between batches of 1 and 2 as requests come, end
    and are cancelled; what each request gets is unchanged."""
    engine, params, greedy, capacity = setup
    live = serving.LiveScheduler(engine, params, greedy, slots=2, capacity=capacity, key=jax.random.key(0),
                                 max_queue=16, buckets=buckets)
    live.start()
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(0, 96, n))) for n in (3, 9, 5, 12, 7, 4)]
    limits = [MAX_NEW, 4, MAX_NEW, 1, 7, MAX_NEW]
    got = [Collector() for _ in prompts]
    threads = [threading.Thread(target=live.submit, args=(p, m, c)) for p, m, c in zip(prompts, limits, got)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, m, c in zip(prompts, limits, got):
        assert c.event.wait(120), "a request never finished"
        want = _alone(setup, p)[:m]
        assert c.tokens == want, (p, m)
        assert c.done["usage"]["completion_tokens"] == len(want) and c.done["usage"]["target_passes"] >= 1
        assert c.done["finish_reason"] == ("length" if len(want) == m else "stop")
    # cancelled right after submission, wherever it got (queue or slot; a round commits at most
    # gamma + 1 = 4 of its 10 tokens, so it cannot finish first); the slots then serve others
    slow, queued, after = Collector(), Collector(), Collector()
    t_slow = live.submit(prompts[0], MAX_NEW, slow)
    live.cancel(t_slow)
    assert slow.event.wait(60) and slow.done["finish_reason"] == "cancelled"
    t_q = live.submit(prompts[1], MAX_NEW, queued)
    live.cancel(t_q)
    assert queued.event.wait(60) and queued.done["finish_reason"] == "cancelled"
    live.submit(prompts[2], MAX_NEW, after)
    assert after.event.wait(60) and after.tokens == _alone(setup, prompts[2])
    # a receiver that raises: its request is cancelled, the engine goes on
    def broken(ev):
        raise RuntimeError("the client's loop is gone")
    live.submit(prompts[3], MAX_NEW, broken)
    fine = Collector()
    live.submit(prompts[4], MAX_NEW, fine)
    assert fine.event.wait(60) and fine.tokens == _alone(setup, prompts[4])
    for _ in range(100):
        if live.snapshot()["active_slots"] == 0:
            break
        time.sleep(0.05)
    s = live.snapshot()
    assert s["error"] is None and s["running"] and s["active_slots"] == 0 and s["queue_depth"] == 0, s
    assert (s["resizes_total"] >= 2) if buckets else (s["resizes_total"] == 0), s
    live.stop(5)
    with pytest.raises(serving.Stopped):
        live.submit(prompts[0], 2, Collector())


def test_bad_submissions_are_named(setup):
    engine, params, greedy, capacity = setup
    live = serving.LiveScheduler(engine, params, greedy, slots=1, capacity=capacity, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"max_tokens=11: a prompt of 3 tokens leaves room for 1 to 10"):
        live.submit([1, 2, 3], MAX_NEW + 1, Collector())
    with pytest.raises(ValueError, match="max_tokens=0"):
        live.submit([1, 2, 3], 0, Collector())
    with pytest.raises(ValueError, match=r"a prompt of 70 tokens leaves room for 1 to 0"):
        live.submit([1] * 70, 1, Collector())
    with pytest.raises(ValueError, match="empty"):
        live.submit([], 1, Collector())
    with pytest.raises(ValueError, match="slots and max_queue must be >= 1"):
        serving.LiveScheduler(engine, params, greedy, slots=0, capacity=capacity, key=jax.random.key(0))
    with pytest.raises(ValueError, match="temperature must be 0"):
        live.submit([1, 2, 3], 2, Collector(), settings=(-1.0, 0, 1.0))
    with pytest.raises(ValueError, match="top_p must be in"):
        live.submit([1, 2, 3], 2, Collector(), settings=(1.0, 0, 1.5))
    with pytest.raises(ValueError, match="seed must be an integer from 0 to 4294967295"):
        live.submit([1, 2, 3], 2, Collector(), seed=2 ** 32)
    with pytest.raises(ValueError, match="one setting"):
        serving.LiveScheduler(engine, params, sampling.SamplingConfig.rows([1.0]), slots=1, capacity=capacity,
                              key=jax.random.key(0))


def test_sampled_and_greedy_requests_share_a_batch(setup):
    """A seeded sampled request (its own temperature and top-k) beside a greedy one: each gets what
    it gets decoded alone (`Engine.run` on a one-row batch with the request's key and settings);
    a stop test ends a request with finish reason "stop"."""
    engine, params, greedy, capacity = setup
    live = serving.LiveScheduler(engine, params, greedy, slots=2, capacity=capacity, key=jax.random.key(0))
    live.warmup()
    live.start()
    prompt, settings, seed = [5, 17, 3, 40], (0.8, 20, 1.0), 77
    sampled, plain, stopped = Collector(), Collector(), Collector()
    live.submit(prompt, MAX_NEW, sampled, settings=settings, seed=seed)
    live.submit([9, 9, 2], MAX_NEW, plain)
    live.submit([9, 9, 2], MAX_NEW, stopped, stop=lambda toks: len(toks) >= 3)
    for c in (sampled, plain, stopped):
        assert c.event.wait(120)
    live.stop(5)
    batch = decoding.make_batch([prompt], engine.config, jax.random.key(seed), request_ids=[0], pad_multiple=64,
                                capacity=capacity)
    out = engine.run(params, sampling.SamplingConfig.rows(*zip(settings)), batch)
    n = int(np.asarray(out.lengths_B)[0]) - len(prompt)
    assert sampled.tokens == [int(x) for x in np.asarray(out.tokens_BS)[0, len(prompt):len(prompt) + n]]
    assert sampled.tokens != _alone(setup, prompt)          # it did sample
    assert plain.tokens == _alone(setup, [9, 9, 2])
    assert stopped.done["finish_reason"] == "stop" and stopped.done["status"] == "stop_sequence"
    assert 3 <= len(stopped.tokens) < MAX_NEW and stopped.tokens == plain.tokens[:len(stopped.tokens)]


def test_a_penalized_request_beside_a_plain_one(setup):
    """A seeded sampled request with penalties beside a greedy one (the round runs the per-row
    program with penalties): each gets what it gets decoded alone."""
    engine, params, greedy, capacity = setup
    live = serving.LiveScheduler(engine, params, greedy, slots=2, capacity=capacity, key=jax.random.key(0))
    live.start()
    prompt, settings, seed = [5, 17, 3, 40], (0.9, 0, 1.0, 0.0, None, 1.4, 0.5, 0.7), 78
    penalized, plain = Collector(), Collector()
    live.submit(prompt, MAX_NEW, penalized, settings=settings, seed=seed)
    live.submit([9, 9, 2], MAX_NEW, plain)
    for c in (penalized, plain):
        assert c.event.wait(120)
    live.stop(5)
    batch = decoding.make_batch([prompt], engine.config, jax.random.key(seed), request_ids=[0], pad_multiple=64,
                                capacity=capacity)
    t, k, p, m, bias, rep, pres, freq = ([x] for x in settings)
    out = engine.run(params, sampling.SamplingConfig.rows(t, k, p, m, bias, rep, pres, freq), batch)
    n = int(np.asarray(out.lengths_B)[0]) - len(prompt)
    assert penalized.tokens == [int(x) for x in np.asarray(out.tokens_BS)[0, len(prompt):len(prompt) + n]]
    assert plain.tokens == _alone(setup, [9, 9, 2])
    with pytest.raises(ValueError, match="repetition_penalty must be a number in"):
        live.submit(prompt, 2, Collector(), settings=(1.0, 0, 1.0, 0.0, None, -1.0, 0.0, 0.0))
