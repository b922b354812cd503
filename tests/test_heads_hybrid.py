"""The hybrid drafter (prompt lookup + a feature head) and the adaptive policy per draft source.

The hybrid's rule and proposals, greedy exactness with the head cache after every commit, its
settings checked; `AdaptiveGamma` keeps one estimate per regime and times each draft source on
its own.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, drafters, trees
from _heads_common import (GREEDY, HYBRID_PROMPTS, MAX_NEW, V, _gen, _head, _hybrid, _hybrid_setup,
                           _kept_slots_vs_fresh, _step_through, _target, _target_only)


def test_hybrid_rule_and_proposals():
    """One `HybridDrafter.propose` (jitted): rows whose longest suffix match has >= min_match
    tokens get exactly the n-gram drafter's proposal (one-hot q), the others exactly the
    head's (tokens and q, same key); when every row matches, the head does not run and its
    state comes back unchanged."""
    eng, ep, batch = _hybrid_setup()
    dr = eng.drafter
    state = eng.init(ep, batch)
    keys = jax.random.split(jax.random.key(5), len(HYBRID_PROMPTS))

    def context(tokens_BS, lengths_B=state.lengths_B):
        return drafters.DraftContext(tokens_BS=tokens_BS, lengths_B=lengths_B, target_cache=state.target_cache,
                                     features=state.features_BSF)

    hybrid = jax.jit(lambda p, s, c, k: dr.propose(p, s, c, k, 3, GREEDY))
    head = jax.jit(lambda p, s, c, k: dr.model.propose(p, s, c, k, 3, GREEDY))
    ngram = jax.jit(lambda c: dr.retrieval.propose(None, None, c, None, 3, GREEDY)[:2])
    rule = jax.jit(dr.uses_lookup)
    ctx = context(state.tokens_BS)
    lookup = np.asarray(rule(ep.draft, ctx))
    assert lookup.tolist() == [True, False, True, False]
    toks, q, new_state = hybrid(ep.draft, state.draft_state, ctx, keys)
    h_toks, h_q, h_state = head(ep.draft, state.draft_state, ctx, keys)
    n_toks, n_q = ngram(ctx)
    for b, use in enumerate(lookup):
        want_t, want_q = (n_toks, n_q) if use else (h_toks, h_q)
        np.testing.assert_array_equal(np.asarray(toks[b]), np.asarray(want_t[b]))
        np.testing.assert_array_equal(np.asarray(q[b]), np.asarray(want_q[b]))
    assert np.asarray(n_toks[0]).tolist() == [6, 5, 6] and np.asarray(n_toks[2]).tolist() == [8, 9, 7]
    for x, y in zip(jax.tree.leaves(new_state), jax.tree.leaves(h_state)):      # the head ran
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Every row repeating (each row given row 0's tokens): lookup only.
    ctx_all = context(jnp.broadcast_to(state.tokens_BS[:1], state.tokens_BS.shape),
                      jnp.broadcast_to(state.lengths_B[:1], state.lengths_B.shape))
    assert np.asarray(rule(ep.draft, ctx_all)).all()
    toks, q, same = hybrid(ep.draft, state.draft_state, ctx_all, keys)
    n_toks, n_q = ngram(ctx_all)
    np.testing.assert_array_equal(np.asarray(toks), np.asarray(n_toks))
    np.testing.assert_array_equal(np.asarray(q), np.asarray(n_q))
    for x, y in zip(jax.tree.leaves(same), jax.tree.leaves(state.draft_state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Rows 1 and 3 finished (`active_B` False): the head does not run for them; the active rows
    # get their lookup proposals.
    ctx_idle = ctx.replace(active_B=jnp.asarray(lookup))
    toks, q, same = hybrid(ep.draft, state.draft_state, ctx_idle, keys)
    n_toks, n_q = ngram(ctx)
    np.testing.assert_array_equal(np.asarray(toks)[lookup], np.asarray(n_toks)[lookup])
    np.testing.assert_array_equal(np.asarray(q)[lookup], np.asarray(n_q)[lookup])
    for x, y in zip(jax.tree.leaves(same), jax.tree.leaves(state.draft_state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # One row (the main command's batch, whose model branch skips the per-row select): each
    # prompt's proposal equals the row's drafter's (the one-row state: its row of the state above,
    # `Engine.resize`, one small program rather than another prefill).
    for b, use in ((0, True), (1, False)):
        st = eng.resize(state, [b])
        c1 = drafters.DraftContext(tokens_BS=st.tokens_BS, lengths_B=st.lengths_B, target_cache=st.target_cache,
                                   features=st.features_BSF)
        toks, q, _ = hybrid(ep.draft, st.draft_state, c1, keys[:1])
        want_t, want_q = ngram(c1) if use else head(ep.draft, st.draft_state, c1, keys[:1])[:2]
        np.testing.assert_array_equal(np.asarray(toks), np.asarray(want_t))
        np.testing.assert_array_equal(np.asarray(q), np.asarray(want_q))


def test_hybrid_greedy_and_head_cache_after_every_commit():
    """Prompt lookup + the 'good' EAGLE head, gamma 3, greedy, round by round: the target-only
    tokens; both drafters draft (rounds mixing both in one batch, and rounds in which every row
    drafts by lookup and the head does not run); after every commit the head's cache keeps
    exactly the slots it should (unchanged after a lookup-only round, else cut back to the
    round's start) and they equal a fresh prefill over the committed tokens with their true
    features, so the head catches up correctly after sitting out."""
    eng, ep, batch = _hybrid_setup()
    rounds, final = _step_through(eng, ep, batch, GREEDY)
    assert decoding.GenerateOutput.from_state(final).generated() == _target_only(HYBRID_PROMPTS)[0]
    rule = jax.jit(eng.drafter.uses_lookup)
    init = eng.init(ep, batch)
    states = [init] + [st for _, st in rounds[:-1]]
    lookup = np.stack([np.asarray(rule(ep.draft, drafters.DraftContext(tokens_BS=jnp.asarray(s.tokens_BS),
                                                             lengths_B=jnp.asarray(s.lengths_B), target_cache=None)))
                       for s in states])
    live = np.stack([~np.asarray(s.done_B) for s in states])
    assert (lookup & live).any() and (~lookup & live).any(), lookup
    assert ((lookup & live).any(axis=1) & (~lookup & live).any(axis=1)).any(), "no round mixed both drafters"
    assert lookup.all(axis=1).any(), "no round in which the head sat out (every row by lookup)"
    # The host replay of the rule (the CLI's report) gives the same rounds.
    lengths = np.stack([np.asarray(s.lengths_B) for s in [init] + [st for _, st in rounds]])
    for b, p in enumerate(HYBRID_PROMPTS):
        sizes = [int(n) for n, a in zip(np.diff(lengths[:, b]), live[:, b]) if a]
        row = np.asarray(final.tokens_BS)[b, :int(lengths[-1, b])].tolist()
        assert eng.drafter.lookup_rounds(row, len(p), sizes) == lookup[:len(sizes), b].tolist()
    m = final.metrics
    assert int(np.asarray(m.accepted_B).sum()) > 0
    # The head's kept slots, exactly: a round in which every active row drafts by lookup leaves the
    # head's cache as it was (the head does not run); any other round cuts every row back to the
    # slots before the round's start, as a head-only round does (the head caught up on all rows).
    kept_before = np.asarray(init.draft_state.cache.kv.lengths_B)
    for r, (before, st) in enumerate(rounds):
        kept = np.asarray(st.draft_state.cache.kv.lengths_B)
        head_sat_out = (lookup[r] | ~live[r]).all()          # finished rows do not keep the head running
        want = kept_before if head_sat_out else np.minimum(np.asarray(st.lengths_B) - 1, before)
        np.testing.assert_array_equal(kept, want, err_msg=f"round {r}, lookup rows {lookup[r]}")
        kept_before = kept
    hc = eng.drafter.model.model.config
    worst = max(_kept_slots_vs_fresh(hc, ep, batch.capacity, st) for _, st in rounds)
    assert worst < 1e-4, f"head cache differs from a fresh true-feature prefill by {worst}"


def test_hybrid_settings_are_checked():
    model, tp = _target()
    head, _ = _head("eagle", "good")
    with pytest.raises(ValueError, match="min_match"):
        _hybrid(head, max_ngram=3, min_match=4)
    with pytest.raises(ValueError, match="vocab mismatch"):
        drafters.HybridDrafter(drafters.NGramDrafter(V + 1), head)
    with pytest.raises(ValueError, match="chains"):
        decoding.Engine(model, _hybrid(head), _gen(trees.TreeShape.from_branching((2, 1))))
    with pytest.raises(ValueError, match="force"):
        dataclasses.replace(_hybrid(head), force=2)


def test_adaptive_policy_keeps_an_estimate_per_regime():
    """`adaptive.update` folds each regime's tested acceptances into that regime's estimate only,
    and remembers the choice of the round's regime only; `choose` prices a round with its own
    regime's estimate and round times; the batch regime is the lowest among active rows."""
    from specjax.decoding import adaptive
    pol = decoding.AdaptiveGamma(gammas=(0, 1, 3), window=4.0, initial_weight=2.0, hysteresis=0.0, initial_alpha=0.5)
    st = adaptive.init_policy(pol, [[1.0, 5.0, 9.0], [1.0, 1.0, 1.0]])
    # jitted (one program each; op by op, every primitive compiles its own)
    choose = jax.jit(lambda st, regime: adaptive.choose(pol, st, regime)[0])
    update = jax.jit(lambda st, *a, regime: adaptive.update(pol, st, *a, regime=regime), static_argnames="regime")
    # At the prior 0.5: gamma 0 is cheapest in regime 0 (a dear draft), gamma 3 in regime 1.
    assert int(choose(st, 0)) == 0 and int(choose(st, 1)) == 2
    new = update(st, jnp.int32(2), jnp.zeros((), bool), jnp.asarray([0.0, 2.7]), jnp.asarray([0, 3]), regime=1)
    kept = 2.0 * 0.75 ** 3                   # the prior's 2 positions, decayed by 3 tested ones
    np.testing.assert_allclose(np.asarray(new.alpha_R), [0.5, (kept * 0.5 + 2.7) / (kept + 3)], rtol=1e-6)
    assert np.asarray(new.index_R).tolist() == [2, 2] and np.asarray(new.since_probe_R).tolist() == [0, 0]
    new = update(new, jnp.int32(0), jnp.zeros((), bool), jnp.asarray([0.4, 0.0]), jnp.asarray([2, 0]), regime=0)
    np.testing.assert_allclose(np.asarray(new.alpha_R), [(2.0 * 0.75 ** 2 * 0.5 + 0.4) / (2.0 * 0.75 ** 2 + 2),
                                                         (kept * 0.5 + 2.7) / (kept + 3)], rtol=1e-6)
    assert np.asarray(new.index_R).tolist() == [0, 2] and np.asarray(new.since_probe_R).tolist() == [1, 0]
    regime = jax.jit(adaptive.batch_regime)
    assert int(regime(jnp.asarray([1, 0, 1]), jnp.asarray([True, True, True]))) == 0
    assert int(regime(jnp.asarray([1, 0, 1]), jnp.asarray([True, False, True]))) == 1
    assert int(regime(jnp.asarray([1, 1]), jnp.asarray([False, False]))) == 0


def test_hybrid_adaptive_gamma_per_draft_source():
    """Adaptive gamma over the hybrid (two rows, greedy) with round times per draft source: the
    model half's rounds priced so that drafting never pays (gamma 0 but for probes), the lookup
    half's so that gamma 3 always does. Every round runs the gamma of its own regime (read before
    the round from the committed tokens: lookup only when every active row drafts by lookup),
    which one pooled estimate and one row of round times could not do; the tokens equal
    target-only greedy. `stream` with every candidate precompiled (the main command's path:
    host dispatch of the chosen round) makes the same rounds and compiles nothing after its
    first round."""
    eng, ep, _ = _hybrid_setup()
    prompts = HYBRID_PROMPTS[0::2]      # two rows that repeat themselves
    policy = decoding.AdaptiveGamma(gammas=(0, 1, 3), probe_every=4)
    eng = dataclasses.replace(eng, config=_gen(policy))
    batch = decoding.make_batch([list(p) for p in prompts], eng.config, jax.random.key(2))
    assert eng.regimes == 2
    times = (1.0, 5.0, 9.0) + (1.0, 1.0, 1.0)           # (model: gamma 0, 1, 3), (lookup: gamma 0, 1, 3)
    state = eng.init(ep, batch, round_time_s=times)
    regime = jax.jit(eng._regime)
    chosen = []                                  # (batch regime, gamma index) per round
    for _ in range(MAX_NEW):
        r = int(regime(ep, state)[0])
        before = np.asarray(state.metrics.gamma_rounds_Z)
        state, _ = eng.step(ep, GREEDY, state)
        chosen.append((r, int(np.argmax(np.asarray(state.metrics.gamma_rounds_Z) - before))))
        if np.asarray(state.done_B).all():
            break
    want = [_target_only(HYBRID_PROMPTS)[0][b] for b in (0, 2)]       # rows 0 and 2 of the reference
    assert decoding.GenerateOutput.from_state(state).generated() == want
    lookup = [g for r, g in chosen if r == drafters.HybridDrafter.LOOKUP]
    model = [g for r, g in chosen if r == drafters.HybridDrafter.MODEL]
    print("\n(regime, gamma index) per round:", chosen)
    assert lookup and model, chosen
    assert set(lookup) == {2}, chosen                     # gamma 3 in every lookup round
    assert set(model) <= {0, 1} and model.count(0) > model.count(1), chosen   # gamma 0, probes at gamma 1
    stream = eng.stream(ep, GREEDY, batch, round_time_s=times, precompile=True)
    events = [next(stream)]
    compiled = decoding.Engine._chosen_round_jit._cache_size()
    events += list(stream)
    assert decoding.Engine._chosen_round_jit._cache_size() == compiled, "a round compiled mid-stream"
    last = events[-1].output
    assert [sum((e.new_tokens[b] for e in events), []) for b in range(len(prompts))] == want
    np.testing.assert_array_equal(np.asarray(last.metrics.gamma_rounds_Z), np.asarray(state.metrics.gamma_rounds_Z))
    np.testing.assert_allclose(np.asarray(last.policy.alpha_R), np.asarray(state.policy.alpha_R), rtol=1e-6)
    with pytest.raises(ValueError, match="per \\(regime, gamma\\)"):
        eng.init(ep, batch, round_time_s=(1.0,) * 5)
    for bad in ((1.0, float("nan"), 1.0), (1.0, 0.0, 1.0) * 2, (1.0, -2.0, 1.0)):
        with pytest.raises(ValueError, match="finite and > 0"):
            eng.init(ep, batch, round_time_s=bad)
    head = eng.drafter.model                    # a drafter that declares two regimes but cannot say which drafts
    two = type("TwoSources", (type(head),), {"capabilities": dataclasses.replace(head.capabilities, regimes=2)})(
        **{f.name: getattr(head, f.name) for f in dataclasses.fields(head) if f.init})
    with pytest.raises(ValueError, match="lacks regime_B or for_regime"):
        decoding.Engine(eng.target, two, eng.config)


def test_round_times_time_each_draft_source_on_its_own(monkeypatch):
    """`Engine.round_times` of a drafter with two sources: each source timed by an engine whose
    drafter is held to it (`for_regime`), with the caller's prefill handed over (its drafter
    relabelled: same state), regime-major; a held drafter drafts every row from its source."""
    eng, ep, batch = _hybrid_setup()
    eng = dataclasses.replace(eng, config=_gen(decoding.AdaptiveGamma(gammas=(0, 1))))
    calls = []
    real_init = decoding.Engine.init

    def recording_init(self, params, b, round_time_s=None, prefill=None):
        calls.append((self.drafter, prefill))
        return real_init(self, params, b, round_time_s, prefill=prefill)

    monkeypatch.setattr(decoding.Engine, "init", recording_init)    # each source's timing starts here
    pre = eng.prefill(ep, batch)
    times = eng.round_times(ep, GREEDY, batch, repeats=1, prefill=pre)
    assert len(times) == 4 and all(t > 0 for t in times)            # (regime, gamma), regime-major
    H = drafters.HybridDrafter
    assert [d for d, _ in calls] == [eng.drafter.for_regime(H.MODEL), eng.drafter.for_regime(H.LOOKUP)]
    assert all(p.drafter == d and p.draft_state is pre.draft_state for d, p in calls)
    # the prompts as committed tokens (what `init` puts in the state's token buffer)
    P = batch.prompt_BP.shape[1]
    tokens_BS = jnp.full((len(HYBRID_PROMPTS), batch.capacity), decoding.PAD_ID, jnp.int32).at[:, :P].set(
        batch.prompt_BP)
    ctx = drafters.DraftContext(tokens_BS=tokens_BS, lengths_B=batch.prompt_lengths_B, target_cache=None)
    regimes = jax.jit(lambda p, c: [d.regime_B(p, c) for d in (eng.drafter, eng.drafter.for_regime(H.MODEL),
                                                                eng.drafter.for_regime(H.LOOKUP))])(ep.draft, ctx)
    both, model_only, lookup_only = (np.asarray(r).tolist() for r in regimes)
    assert both == [H.LOOKUP, H.MODEL, H.LOOKUP, H.MODEL]
    assert model_only == [H.MODEL] * 4 and lookup_only == [H.LOOKUP] * 4
