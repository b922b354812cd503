"""Drafters in isolation and in the loop: n-gram matching rules, early exit on a real Llama."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import build, decoding, drafters, models, sampling


def _ngram(tokens, length, gamma=3, max_ngram=3, min_ngram=1):
    d = drafters.NGramDrafter(vocab_size=50, max_ngram=max_ngram, min_ngram=min_ngram)
    buf = jnp.asarray([tokens + [0] * 8], jnp.int32)
    lens = jnp.asarray([length], jnp.int32)
    toks, q, _ = d.propose(None, d.init(None, buf, lens, 0), buf, lens, None, gamma, None)
    return np.asarray(toks)[0].tolist(), np.asarray(q), int(d.match_end(buf, lens)[0])


def test_ngram_prefers_longest_then_latest_match():
    # suffix [7, 8, 9]: the 3-gram occurs at 0..2 (followed by 1); [8, 9] also at 5..6 (followed by 2).
    seq = [7, 8, 9, 1, 5, 8, 9, 2, 7, 8, 9]
    toks, q, end = _ngram(seq, len(seq))
    assert end == 2 and toks == [1, 5, 8]
    # with max_ngram=2 the latest 2-gram [8, 9] wins instead
    toks, _, end = _ngram(seq, len(seq), max_ngram=2)
    assert end == 6 and toks == [2, 7, 8]
    assert np.allclose(q.sum(-1), 1.0) and set(np.unique(q)) <= {0.0, 1.0}


def test_ngram_continues_cyclically_and_handles_no_match():
    toks, _, end = _ngram([4, 5, 4, 5], 4, gamma=4)
    assert end == 1 and toks == [4, 5, 4, 5]    # copies tokens[2:4] and keeps repeating them
    toks, _, end = _ngram([1, 2, 3], 3, gamma=2)
    assert end == -1 and toks == [3, 3]         # no match: repeat the last token (one-hot q)


def test_ngram_ignores_tokens_past_the_committed_length():
    # a match only inside the uncommitted tail (positions >= length) must not be used
    toks, _, end = _ngram([1, 2, 3, 9, 9, 9], 3)
    assert end == -1


@pytest.fixture(scope="module")
def llama():
    cfg = models.ModelConfig(vocab_size=97, hidden_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
                             head_dim=12, ffn_size=96)
    model = models.Llama(cfg)
    # Random weights scaled up so every layer matters: the early exit then disagrees often.
    params = jax.tree.map(lambda x: x * 12.0 if x.ndim >= 2 else x, model.init_params(jax.random.key(3)))
    return model, params


@pytest.mark.parametrize("kind", ["early_exit", "early_exit_own_cache"])
def test_early_exit_greedy_equals_target_only(llama, kind):
    model, params = llama
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [20]]
    pr, pl = decoding.pad_prompts(prompts, model.vocab_size)
    keys = decoding.request_keys(jax.random.key(0), range(4))
    greedy = sampling.SamplingConfig.make(0.0)
    ref = decoding.autoregressive_generate(model, params, pr, pl, keys, greedy, 20)
    d, dp = build.make_drafter(kind, model, params, early_exit_layers=2)
    out = decoding.speculative_generate(model, params, d, dp, pr, pl, keys, greedy,
                                        decoding.GenerationConfig(20, gamma=3))
    assert out.generated() == ref.generated()
    acc, prop = int(out.metrics.accepted_B.sum()), int(out.metrics.proposed_B.sum())
    full = int(out.metrics.accepted_at_BG[:, -1].sum())
    assert 0 < acc < prop, (acc, prop)   # both acceptances and rejections happened
    assert full > 0                      # and at least one fully accepted round


def test_shared_cache_early_exit_matches_own_cache_draft(llama):
    """The shared-cache draft sees the same context as a separately cached copy of the same
    layers: their greedy proposals, hence acceptance counts, agree."""
    model, params = llama
    pr, pl = decoding.pad_prompts([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]], model.vocab_size)
    keys = decoding.request_keys(jax.random.key(0), range(2))
    greedy = sampling.SamplingConfig.make(0.0)
    outs = []
    for kind in ("early_exit", "early_exit_own_cache"):
        d, dp = build.make_drafter(kind, model, params, early_exit_layers=2)
        outs.append(decoding.speculative_generate(model, params, d, dp, pr, pl, keys, greedy,
                                                  decoding.GenerationConfig(16, gamma=2)))
    assert outs[0].generated() == outs[1].generated()
    np.testing.assert_array_equal(outs[0].metrics.accepted_at_BG, outs[1].metrics.accepted_at_BG)


def test_early_exit_rejects_bad_depth(llama):
    model, params = llama
    with pytest.raises(ValueError):
        drafters.EarlyExitDrafter.from_target(model, params, 0)
    with pytest.raises(ValueError):
        drafters.EarlyExitDrafter.from_target(model, params, 5)
