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
    context = drafters.DraftContext(tokens_BS=buf, lengths_B=lens, target_cache=None)
    toks, q, _ = d.propose(None, d.init(None, buf, lens, 0), context, None, gamma, None)
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


def _longest_match_reference(tokens, max_ngram, min_ngram):
    """(end, n) by brute force: the longest n whose suffix n-gram also ends at an earlier
    position, and the latest such position; (-1, 0) if none."""
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        ends = [i for i in range(n - 1, L - 1) if tokens[i - n + 1:i + 1] == tokens[L - n:]]
        if ends:
            return ends[-1], n
    return -1, 0


def test_ngram_longest_match_equals_a_brute_force_reference():
    """`longest_match` (the hybrid drafter's rule and the n-gram proposal's match) against a
    plain-Python search on random rows over 3 tokens (matches of every length, and none),
    padded past their lengths with a token that would match if it were read."""
    rng = np.random.default_rng(0)
    for max_ngram, min_ngram in ((3, 1), (2, 2), (4, 2)):
        d = drafters.NGramDrafter(vocab_size=50, max_ngram=max_ngram, min_ngram=min_ngram)
        rows = [rng.integers(0, 3, int(n)).tolist() for n in rng.integers(1, 12, 64)]
        buf = jnp.asarray([r + [r[-1]] * (12 - len(r)) for r in rows], jnp.int32)
        end_B, n_B = d.longest_match(buf, jnp.asarray([len(r) for r in rows], jnp.int32))
        got = list(zip(np.asarray(end_B).tolist(), np.asarray(n_B).tolist()))
        assert got == [_longest_match_reference(r, max_ngram, min_ngram) for r in rows]
        assert len({n for _, n in got}) >= 2


GREEDY = sampling.SamplingConfig.make(0.0)


def _generate(model, params, drafter, draft_params, prompts, config):
    batch = decoding.make_batch(prompts, config, jax.random.key(0))
    engine = decoding.Engine(model, drafter, config)
    return engine.run(decoding.EngineParams(target=params, draft=draft_params), GREEDY, batch)


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
    ref = _generate(model, params, None, None, prompts, decoding.GenerationConfig(20, gamma=0))
    d, dp = build.make_drafter(kind, model, params, early_exit_layers=2)
    out = _generate(model, params, d, dp, prompts, decoding.GenerationConfig(20, gamma=3))
    assert out.generated() == ref.generated()
    acc, prop = int(out.metrics.accepted_B.sum()), int(out.metrics.proposed_B.sum())
    full = int(out.metrics.accepted_at_BG[:, -1].sum())
    assert 0 < acc < prop, (acc, prop)   # both acceptances and rejections happened
    assert full > 0                      # and at least one fully accepted round


def test_shared_cache_early_exit_matches_own_cache_draft(llama):
    """The shared-cache draft sees the same context as a separately cached copy of the same
    layers: their greedy proposals, hence acceptance counts, agree."""
    model, params = llama
    outs = []
    for kind in ("early_exit", "early_exit_own_cache"):
        d, dp = build.make_drafter(kind, model, params, early_exit_layers=2)
        outs.append(_generate(model, params, d, dp, [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]],
                              decoding.GenerationConfig(16, gamma=2)))
    assert outs[0].generated() == outs[1].generated()
    np.testing.assert_array_equal(outs[0].metrics.accepted_at_BG, outs[1].metrics.accepted_at_BG)


def test_early_exit_rejects_bad_depth(llama):
    model, params = llama
    with pytest.raises(ValueError):
        drafters.EarlyExitDrafter.from_target(model, params, 0)
    with pytest.raises(ValueError):
        drafters.EarlyExitDrafter.from_target(model, params, 5)


def test_early_exit_drafts_from_the_target_cache_in_its_context(llama):
    """The early-exit drafter keeps no cache: it reads the target's cache from the
    `DraftContext` it is handed. Its greedy proposals on the prefilled target cache equal a
    cache-free greedy rollout of the truncated model on the committed tokens; handed another
    prompt's cache with the same tokens, it proposes something else (it did read the cache)."""
    model, params = llama
    d, dp = drafters.EarlyExitDrafter.from_target(model, params, 2)
    config = decoding.GenerationConfig(8, gamma=3)
    engine = decoding.Engine(model, d, config)
    ep = decoding.EngineParams(target=params, draft=dp)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    batch = decoding.make_batch(prompts, config, jax.random.key(0))
    state = engine.init(ep, batch)

    @jax.jit
    def propose(target_cache):
        context = drafters.DraftContext(tokens_BS=state.tokens_BS, lengths_B=state.lengths_B,
                                        target_cache=target_cache)
        return d.propose(dp, state.draft_state, context, batch.key_B, 3, GREEDY)[0]

    # cache-free reference: one causal forward over right-padded rows per drafted token
    forward = jax.jit(lambda p, t: d.model.apply(p, t, None)[0])
    seqs = [list(p) for p in prompts]
    width = max(len(p) for p in prompts) + 3      # one shape for all three forwards
    for _ in range(3):
        logits = forward(dp, jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32))
        for b, s in enumerate(seqs):
            s.append(int(jnp.argmax(logits[b, len(s) - 1])))
    got = np.asarray(propose(state.target_cache)).tolist()
    assert got == [s[len(p):] for s, p in zip(seqs, prompts)]
    other = engine.init(ep, decoding.make_batch([[40, 41, 42, 43, 44, 45, 46, 47], [50, 51, 52, 53]], config,
                                                 jax.random.key(0)))
    assert np.asarray(propose(other.target_cache)).tolist() != got
