"""Long prompts (issue 18 item 10): chunked prefill gives the same cache as one call, and its
temporaries are bounded by one chunk's, not by the prompt length.

A tiny random Llama with a 4096-position context. The unchunked prefill of a P-token prompt
holds P x capacity attention scores per head at once; chunks of C tokens hold C x capacity.
The bound is read from XLA's own memory analysis of the compiled prefill program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, drafters, models, sampling

CONFIG = models.ModelConfig(vocab_size=101, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, ffn_size=48, rope_theta=10000.0, rms_eps=1e-5, max_position=4096,
                            scan_layers=False)


def _model():
    model = models.Llama(CONFIG)
    return model, model.init_params(jax.random.key(0))


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, CONFIG.vocab_size, n).tolist() for n in lengths]


def _ragged(lengths, seed=0):
    prompts = _prompts(lengths, seed)
    P = max(map(len, prompts))
    tokens = jnp.asarray([p + [0] * (P - len(p)) for p in prompts], jnp.int32)
    return tokens, jnp.asarray([len(p) for p in prompts], jnp.int32)


def _assert_same_entries(got_cache, want_cache, valid, atol, what):
    """Every layer's keys and values in each row's first ``valid`` slots agree within ``atol``
    (only those slots are compared)."""
    for l in range(CONFIG.num_layers):
        for got, want in zip(got_cache.layer(l), want_cache.layer(l)):
            got, want = np.asarray(got), np.asarray(want)
            for b, n in enumerate(np.asarray(valid)):
                g, w = got[b], want[b]
                g, w = (g[:, :n], w[:, :n]) if g.shape[1] == got_cache.capacity else (g[..., :n], w[..., :n])
                np.testing.assert_allclose(g, w, atol=atol, err_msg=f"{what} layer {l} row {b}")


# One jitted prefill for the tests below (model, chunk and start_bound static, passed by name
# alike so the calls share a cache entry): a program the tests share (the unrolled layout's
# chunks of 300 over a full-capacity cache) compiles once.
_prefill = jax.jit(models.prefill, static_argnums=0, static_argnames=("chunk", "start_bound"))


def test_chunked_prefill_fills_the_same_cache_as_one_call():
    """Chunks of 300 (dividing neither row, of 1,100 and 700 tokens) fill the cache of one call.
    (Chunks of 256 in the engine: test_engine_with_a_long_prompt_matches_one_call_prefill.)"""
    model, params = _model()
    tokens, valid = _ragged([1100, 700])
    one, chunked = (_prefill(model, params, tokens, model.init_cache(2, 1280), valid, chunk=chunk, start_bound=None)
                    for chunk in (None, 300))
    np.testing.assert_array_equal(np.asarray(chunked.lengths_B), np.asarray(valid))
    _assert_same_entries(chunked, one, valid, 2e-5, "chunk 300")


def test_engine_with_a_long_prompt_matches_one_call_prefill():
    """The engine's first decode logits after a chunked prefill equal those after one call, and
    generation with chunking answers (rows of 700 and 40 tokens, chunks of 256: the last one
    partial)."""
    model, params = _model()
    prompts = _prompts([700, 40], seed=1)

    @jax.jit          # (one program for both states: op by op, every run compiled dozens)
    def next_logits(params, state):
        last = jnp.take_along_axis(state.tokens_BS, (state.lengths_B - 1)[:, None], axis=1)
        return model.apply(params, last, state.target_cache)[0]

    outs = {}
    for chunk in (None, 256):
        config = decoding.GenerationConfig(max_new_tokens=4, gamma=0, prefill_chunk=chunk)
        engine = decoding.Engine(model, None, config)
        batch = decoding.make_batch(prompts, config, jax.random.key(0))
        state = engine.init(decoding.EngineParams(target=params), batch)
        outs[chunk] = np.asarray(next_logits(params, state))
        if chunk is not None:           # (generation with one call's prefill is every other test's)
            out = engine.run(decoding.EngineParams(target=params), sampling.SamplingConfig.greedy_config(), batch)
            assert [len(g) for g in out.generated()] == [4, 4]
    np.testing.assert_allclose(outs[256], outs[None], atol=1e-4)


def _prefill_temp_bytes(chunk, P=2048, capacity=2304):
    model, params = _model()
    tokens = jnp.zeros((1, P), jnp.int32)
    valid = jnp.full((1,), P, jnp.int32)
    fn = jax.jit(lambda pr, t, c, v: models.prefill(model, pr, t, c, v, chunk), donate_argnums=2)
    return fn.lower(params, tokens, model.init_cache(1, capacity), valid).compile().memory_analysis().temp_size_in_bytes


def test_chunked_prefill_temporaries_are_bounded_by_one_chunk():
    """XLA's memory analysis of the compiled prefill: one call's temporaries grow with the
    prompt (P x capacity scores; x2.6 from 1,024 to 2,048 tokens here), chunked ones stay about
    one chunk's (scores, mask, softmax: a few score-sized buffers), far below one call's."""
    P, S, C = 2048, 2304, 128
    whole, whole_half = _prefill_temp_bytes(None, P, S), _prefill_temp_bytes(None, P // 2, S)
    chunked, chunked_half = _prefill_temp_bytes(C, P, S), _prefill_temp_bytes(C, P // 2, S)
    scores_per_chunk = CONFIG.num_heads * C * (S + C) * 4          # float32 scores of one chunk, one layer
    assert whole > 2 * whole_half, (whole, whole_half)
    assert chunked <= 1.25 * chunked_half, (chunked, chunked_half)
    assert chunked <= 8 * scores_per_chunk, (chunked, scores_per_chunk)
    assert whole > 8 * chunked, (whole, chunked)


def test_prefill_of_a_fresh_cache_reads_only_earlier_slots_and_fills_the_same_cache():
    """``start_bound=0`` (a fresh cache): each chunk attends to the slots before it instead of
    the whole capacity. Same entries as the full-capacity prefill (masked slots weigh exactly 0,
    so only summation order differs), in both cache layouts, ragged rows, a chunk that does not
    divide the prompt; the attend limit is cleared on return. (Chunks of 300 only: the first is
    what a one-call prefill of a fresh cache runs, a plain causal forward (attend limit 0), and the
    later ones attend to the slots before them; each layout compiles its two prefills once, the
    unrolled full-capacity one shared with test_chunked_prefill_fills_the_same_cache_as_one_call.)"""
    tokens, valid = _ragged([1100, 700])
    chunk = 300
    for scan in (False, True):
        model = models.Llama(dataclasses.replace(CONFIG, scan_layers=scan))
        params = model.init_params(jax.random.key(0))
        full, limited = (_prefill(model, params, tokens, model.init_cache(2, 1280), valid, chunk=chunk, start_bound=b)
                         for b in (None, 0))
        assert limited.attend_limit is None
        np.testing.assert_array_equal(np.asarray(limited.lengths_B), np.asarray(valid))
        _assert_same_entries(limited, full, valid, 1e-5, f"scan {scan} chunk {chunk}")


def _prefill_flops(capacity, start_bound, P=512, chunk=256):
    model, params = _model()
    tokens = jnp.zeros((1, P), jnp.int32)
    valid = jnp.full((1,), P, jnp.int32)
    fn = jax.jit(lambda pr, t, c, v: models.prefill(model, pr, t, c, v, chunk, start_bound=start_bound))
    cost = fn.lower(params, tokens, model.init_cache(1, capacity), valid).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return cost["flops"]


def test_prefill_work_grows_with_the_prompt_not_the_capacity():
    """XLA's cost analysis of the compiled prefill (512 tokens in two chunks of 256): with a fresh
    cache's bound the work is the same for a cache of 576 or 4,096 slots (it attends only to the
    prompt's own causal triangle); without it the work grows with the capacity."""
    small, big = _prefill_flops(576, 0), _prefill_flops(4096, 0)
    small_full, big_full = _prefill_flops(576, None), _prefill_flops(4096, None)
    assert big == small, (small, big)
    assert big_full > 1.5 * small_full, (small_full, big_full)
    assert small < small_full, (small, small_full)


def test_attend_limit_is_checked():
    model, params = _model()
    cache = model.init_cache(1, 64)
    for bad in (-1, 65):
        try:
            cache.limit_attention(bad)
        except ValueError as e:
            assert "attend limit" in str(e)
        else:
            raise AssertionError(f"limit {bad} accepted")
    try:
        models.prefill(model, params, jnp.zeros((1, 4), jnp.int32), cache, jnp.array([4]), start_bound=-1)
    except ValueError as e:
        assert "start_bound" in str(e)
    else:
        raise AssertionError("negative start_bound accepted")


def _one_layer_draft(model, params):
    """(a draft model of the target's first layer, with its embedding, final norm and head; its
    params): the speculative engines below (the draft keeps a cache of its own)."""
    layers = params["layers"]
    layers = layers[:1] if isinstance(layers, (tuple, list)) else jax.tree.map(lambda x: x[:1], layers)
    return drafters.ModelDrafter(models.Llama(model.config.replace(num_layers=1))), {**params, "layers": layers}


# Prompt lengths (seed 4) of the three tests below. Shorter than the default prefill chunk (512):
# reusing a prefill does not depend on how it was computed (chunked prefill is the tests above).
CONSUME_PROMPTS = [400, 40, 150]


def test_one_prefill_serves_every_run_on_the_batch():
    """`Engine.prefill` once, then the speculative run, the target-only engine's run and the
    round-time calibration all start from it: the outputs equal those of runs that prefill
    themselves, and a prefill made for another batch is refused."""
    model, params = _model()
    drafter, dparams = _one_layer_draft(model, params)
    config = decoding.GenerationConfig(max_new_tokens=6, gamma=2)
    spec = decoding.Engine(model, drafter, config)
    only = decoding.Engine(model, None, dataclasses.replace(config, gamma=0))
    ep = decoding.EngineParams(target=params, draft=dparams)
    # The engines, batch and sampling of test_a_run_that_consumes_its_prefill_holds_the_caches_once's
    # per-layer case: the speculative engine's prefill and its run from a kept prefill are compiled
    # once for both tests.
    batch = decoding.make_batch(_prompts(CONSUME_PROMPTS, seed=4), config, jax.random.key(2))
    samp = sampling.SamplingConfig.make(temperature=1.0)
    pre = spec.prefill(ep, batch)
    for engine in (spec, only):
        want = engine.run(ep, samp, batch)
        got = engine.run(ep, samp, batch, prefill=pre)
        np.testing.assert_array_equal(np.asarray(got.tokens_BS), np.asarray(want.tokens_BS))
        again = engine.run(ep, samp, batch, prefill=pre)      # not donated: reusable
        np.testing.assert_array_equal(np.asarray(again.tokens_BS), np.asarray(want.tokens_BS))
    assert len(spec.round_times(ep, samp, batch, repeats=1, prefill=pre)) == 1
    other = decoding.make_batch(_prompts(CONSUME_PROMPTS[:-1] + [CONSUME_PROMPTS[-1] + 1], seed=4), config,
                                jax.random.key(2))
    try:
        spec.run(ep, samp, other, prefill=pre)
    except ValueError as e:
        assert "different batch" in str(e)
    else:
        raise AssertionError("a prefill for another batch was accepted")


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per_layer"])
def test_a_run_that_consumes_its_prefill_holds_the_caches_once(per_layer):
    """`Engine.run(prefill=pre, consume_prefill=True)` (the data engine's batches): the same
    tokens and metrics as the run that keeps the prefill, for target-only and speculative
    engines; the prefill's buffers are donated (deleted after the call, with no "donated buffers
    were not usable" warning; a later run given it is refused by name); and XLA's memory
    analysis of the compiled run shows no second target cache: its temporaries are smaller than
    the keeping run's by at least 0.9 of the cache's bytes (the keeping run's loop works on a
    copy of the prefill's cache)."""
    import warnings
    model = models.Llama(CONFIG.replace(scan_layers=not per_layer))
    params = model.init_params(jax.random.key(0))
    config = decoding.GenerationConfig(max_new_tokens=6, gamma=2)
    drafter, dparams = _one_layer_draft(model, params)
    spec = decoding.Engine(model, drafter, config)
    only = decoding.Engine(model, None, dataclasses.replace(config, gamma=0))
    ep = decoding.EngineParams(target=params, draft=dparams)
    batch = decoding.make_batch(_prompts(CONSUME_PROMPTS, seed=4), config, jax.random.key(2))
    samp = sampling.SamplingConfig.make(temperature=1.0)
    cache_bytes = batch.prompt_BP.shape[0] * decoding.cache_bytes_per_row(only, batch.capacity)
    for engine in (only, spec):
        want = engine.run(ep, samp, batch, prefill=engine.prefill(ep, batch))
        pre = engine.prefill(ep, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("error")           # an unusable donation warns: fail on it
            got = engine.run(ep, samp, batch, prefill=pre, consume_prefill=True)
        assert got.generated() == want.generated()
        for x, y in zip(jax.tree.leaves(got.metrics), jax.tree.leaves(want.metrics)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert all(x.is_deleted() for x in jax.tree.leaves(pre.target_cache) if np.ndim(x) > 1)
        with pytest.raises(ValueError, match="consumed by an earlier run"):      # named, not a deleted-array error
            engine.run(ep, samp, batch, prefill=pre)
        # compiled memory of the two programs on the same arguments
        pre = engine.prefill(ep, batch)
        args = (ep, samp, batch.prompt_BP, batch.prompt_lengths_B, batch.key_B, engine._round_time_RZ(None))
        parts = engine._pre(batch, pre)
        temp = {name: fn.lower(engine, *args, capacity=batch.capacity, pre=parts).compile()
                .memory_analysis().temp_size_in_bytes
                for name, fn in (("keep", engine._run_jit), ("consume", engine._run_consuming_jit))}
        assert temp["consume"] <= temp["keep"] - 0.9 * cache_bytes, (temp, cache_bytes)


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per_layer"])
def test_a_repeated_one_row_prefill_equals_prefilling_every_row(per_layer):
    """`Prefill.repeat`: n samples of one prompt from one prefill give exactly the tokens of a
    run that prefills all n rows (T = 1, every row its own key), target and draft caches both;
    a multi-row prefill or a batch of another prompt is refused."""
    model = models.Llama(CONFIG.replace(scan_layers=not per_layer))
    params = model.init_params(jax.random.key(0))
    config = decoding.GenerationConfig(max_new_tokens=6, gamma=2)
    drafter, dparams = _one_layer_draft(model, params)
    engine = decoding.Engine(model, drafter, config)
    ep = decoding.EngineParams(target=params, draft=dparams)
    # Three rows of one 400-token prompt: the batch shape of CONSUME_PROMPTS, so
    # the run from a prefill is the program test_a_run_that_consumes_its_prefill_holds_the_caches_once
    # compiled for this engine (and, per layer, the run without one test_one_prefill_serves_every_run_on_the_batch's).
    n = len(CONSUME_PROMPTS)
    prompt = _prompts([max(CONSUME_PROMPTS)], seed=5)[0]
    key = jax.random.key(4)
    one = engine.prefill(ep, decoding.make_batch([prompt], config, key, request_ids=[0]))
    rows = decoding.make_batch([prompt] * n, config, key, request_ids=list(range(n)))
    samp = sampling.SamplingConfig.make(temperature=1.0)
    want = engine.run(ep, samp, rows)
    got = engine.run(ep, samp, rows, prefill=one.repeat(rows))
    np.testing.assert_array_equal(np.asarray(got.tokens_BS), np.asarray(want.tokens_BS))
    assert len({tuple(r) for r in want.generated()}) > 1            # the rows did sample differently
    with pytest.raises(ValueError, match="one-row prefill"):
        one.repeat(rows).repeat(rows)                                 # (a 3-row prefill)
    other = decoding.make_batch([prompt[:-1]] * n, config, key, request_ids=list(range(n)))
    with pytest.raises(ValueError, match="every row of the batch must be this prefill's prompt"):
        one.repeat(other)
