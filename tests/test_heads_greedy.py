"""Greedy exactness of feature-level draft heads and the caches they keep (tiny random Llamas).

1. Greedy exactness against a cache-free target-only reference, ragged batch (prompt lengths
   1, 2, 5, 9; chunked prefill): Medusa and EAGLE at gamma 3 round by round, and Medusa and a
   reduced-vocabulary EAGLE-3 head with input norms (both on the stacked target layout) under
   `AdaptiveGamma` (0, 1, 3), mixed and pinned to gamma 1 or 3 through the round-time table
   (the same compiled program); a run that consumes its prefill under that policy equals the
   run without one. A zero-initialised Medusa head drafts the target's own greedy choice at
   ``L - 2``: its rounds and accepted counts are predicted exactly.
2. Feature rollback: after every round the features a head can read (positions < L - 1)
   equal a fresh cache-free forward over the committed tokens; the EAGLE head's cache after
   every commit equals a fresh head prefill over the committed tokens with their true
   features (chains and token trees); a head whose commit keeps slots made from its own
   predictions fails that check.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, drafters, trees
from _heads_common import (ADAPTIVE, GREEDY, GREEDY_CASES, HEAD_TREES, MAX_NEW, MIXED, PIN_G1, PROMPTS, TOL,
                           _assert_committed_features, _assert_target_tokens, _eagle_setup, _eagle_stepped,
                           _head_cache_mismatch, _head_config, _head_engine, _jit_apply, _medusa_stepped, _run_head,
                           _target, _target_only)


def test_target_sequences_are_not_trivial():
    """Guards the greedy tests: the target's continuations vary (not one repeated token) but
    repeat sometimes (so a head drafting the last token is accepted now and then)."""
    gen = _target_only()[0]
    for g in gen:
        assert len(set(g)) >= 4, gen
    repeats = sum(a == b for g in gen for a, b in zip(g, g[1:]))
    assert 3 <= repeats <= 0.6 * sum(len(g) - 1 for g in gen), gen


@pytest.mark.parametrize("kind,scan,gamma,mode,round_times", GREEDY_CASES,
                         ids=[f"{k}-{'scan' if s else 'unrolled'}-g{g}-{m}" + ("" if r is None else f"-rt{r}")
                              for k, s, g, m, r in GREEDY_CASES])
def test_greedy_head_matches_target_only(kind, scan, gamma, mode, round_times):
    """(Medusa and the plain EAGLE head at gamma 3 are checked round by round on the unrolled
    target in test_medusa_greedy_and_features_after_every_round and
    test_eagle_greedy_and_head_cache_after_every_commit.) Gamma 1 runs as the adaptive policy
    pinned to it (PIN_G1): the gamma-1 branch of the same compiled loop. Both heads run on the
    stacked (lax.scan) target layout, whose feature collection is a separate code path; the
    reference is the cache-free greedy of the unrolled target (same weights). The EAGLE-3 head
    has a 40-token reduced vocabulary and input norms. (The reduced EAGLE-3 head without input
    norms runs greedy in the engine in test_heads_engine.py::test_packed_head_drafts_as_the_plain_head
    on the unrolled packed target, and on the stacked target in
    test_sampling_penalties.py::test_heads_with_penalties_keep_greedy_rows_target_only.)"""
    out = _run_head(kind, mode, gamma, scan, round_times)
    _assert_target_tokens(out)
    m = out.metrics
    rounds = np.asarray(m.rounds_B)
    if gamma == "adaptive":
        k = np.asarray(m.gamma_rounds_Z)
        assert k.sum() == rounds.max()
        if round_times == MIXED:
            assert k[0] > 0 and k[1:].sum() > 0, f"the adaptive run must mix gamma 0 and drafting rounds: {k}"
        else:
            assert k[ADAPTIVE.gammas.index(1 if round_times == PIN_G1 else 3)] == k.sum(), k
    else:
        np.testing.assert_array_equal(np.asarray(m.proposed_B), gamma * rounds)
    if mode == "good":
        assert int(np.asarray(m.accepted_B).sum()) > 0, "a 'good' head must get drafts accepted"


def test_a_run_consuming_the_prefill_under_adaptive_gamma_equals_the_run_without_it():
    """`run(prefill=pre, consume_prefill=True)` with a feature head (the target's features and
    the head's state donated with the cache) under adaptive gamma with 0 among its choices and
    round times that mix gamma 0 and drafting rounds (the loop's inner gamma-0 loop and its
    switch): the tokens and metrics of the same engine's run without a prefill (the MIXED case
    above, memoised), every donated buffer taken (deleted, no unusable-donation warning). (At a
    fixed gamma, against the run that keeps the prefill:
    test_heads_engine.py::test_a_run_consuming_the_eagle_prefill_equals_the_keeping_run.)"""
    case = ("eagle3_norm", "random", "adaptive", True)
    eng, ep, batch = _head_engine(*case)
    want = _run_head(*case, MIXED)
    pre = eng.prefill(ep, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = eng.run(ep, GREEDY, batch, round_time_s=MIXED, prefill=pre, consume_prefill=True)
    assert got.generated() == want.generated() == _target_only()[0]
    for x, y in zip(jax.tree.leaves(got.metrics), jax.tree.leaves(want.metrics)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    k = np.asarray(got.metrics.gamma_rounds_Z)
    assert k[0] > 0 and k[1:].sum() > 0, k
    assert pre.features_BSF.is_deleted()
    assert all(x.is_deleted() for x in jax.tree.leaves(pre.target_cache) if np.ndim(x) > 1)
    assert all(x.is_deleted() for x in jax.tree.leaves(pre.draft_state) if np.ndim(x) > 1)


def test_zero_medusa_acceptance_is_exactly_predicted():
    """Medusa with W = 0, b = 0: every head is the target's own head on ``f_{L-2}``, so each
    round drafts the target's greedy choice at position L - 2, gamma times: the last committed
    token once it was generated, the target's argmax there while it is a prompt token, and
    token 0 when L = 1 (the zero feature gives all-equal logits). Simulating the rounds on the
    target's greedy sequence predicts every row's rounds and accepted counts exactly (accepted
    counts drafts the max_new_tokens limit then cuts: hence the EXTRA reference tokens). A
    head reading any other position than L - 2 fails this."""
    gamma = 3
    _, final = _medusa_stepped("zero")
    out = decoding.GenerateOutput.from_state(final)
    _assert_target_tokens(out)
    model, tp = _target()
    seqs = [list(p) + g for p, g in zip(PROMPTS, _target_only()[1])]
    width = max(map(len, seqs))
    padded = np.array([s + [0] * (width - len(s)) for s in seqs], np.int32)
    argmax_BT = np.asarray(_jit_apply(model)(tp, padded, None)[0]).argmax(-1)
    rounds, accepted = [], []
    for prompt, seq, argmax in zip(PROMPTS, seqs, argmax_BT):
        np.testing.assert_array_equal(argmax[len(prompt) - 1:len(seq) - 1], seq[len(prompt):])   # greedy
        L, r, a = len(prompt), 0, 0
        while L - len(prompt) < MAX_NEW:
            draft = argmax[L - 2] if L >= 2 else 0
            n = 0
            while n < gamma and seq[L + n] == draft:
                n += 1
            r, a, L = r + 1, a + n, L + n + 1
        rounds.append(r)
        accepted.append(a)
    m = out.metrics
    np.testing.assert_array_equal(np.asarray(m.rounds_B), rounds)
    np.testing.assert_array_equal(np.asarray(m.accepted_B), accepted)
    assert 0 < sum(accepted) < gamma * sum(rounds)


@pytest.mark.parametrize("mode", ["random", "zero"])
def test_medusa_greedy_and_features_after_every_round(mode):
    """Medusa, gamma 3, greedy, round by round (`Engine.step`): the target-only tokens, and the
    features a head can read are the committed ones (see _assert_committed_features; with
    W = 0 drafts are both accepted and rejected)."""
    rounds, final = _medusa_stepped(mode)
    _assert_target_tokens(decoding.GenerateOutput.from_state(final))
    m = final.metrics
    np.testing.assert_array_equal(np.asarray(m.proposed_B), 3 * np.asarray(m.rounds_B))
    if mode == "zero":
        acc, prop = int(np.asarray(m.accepted_B).sum()), int(np.asarray(m.proposed_B).sum())
        assert 0 < acc < prop, f"need both accepted and rejected drafts ({acc} of {prop})"
    _assert_committed_features(rounds, final, _head_config("medusa").feature_layers)


@pytest.mark.parametrize("mode", ["random", "good"])
def test_eagle_greedy_and_head_cache_after_every_commit(mode):
    """EAGLE head, gamma 3, greedy, round by round (`Engine.step`): the tokens are the
    target-only ones, and after every commit the head's cache equals a fresh head prefill
    over the committed tokens with the target's true features (only slots whose input feature
    was the target's survive a commit)."""
    rounds, final = _eagle_stepped(mode)
    _assert_target_tokens(decoding.GenerateOutput.from_state(final))
    m = final.metrics
    acc, prop = int(np.asarray(m.accepted_B).sum()), int(np.asarray(m.proposed_B).sum())
    if mode == "good":     # slots made from predictions existed and had to be dropped
        assert 0 < acc < prop and (np.asarray(m.accepted_at_BG)[:, 1] > 0).any(), (acc, prop)
    _assert_committed_features(rounds, final, _head_config("eagle").feature_layers)
    worst = _head_cache_mismatch(mode)
    assert worst < 1e-4, f"head cache differs from a fresh true-feature prefill by {worst}"


@pytest.mark.parametrize("tree", list(HEAD_TREES))
def test_eagle_tree_greedy_and_head_cache_after_every_commit(tree):
    """EAGLE head drafting token trees (EAGLE-2 dynamic and a static tree), greedy, round by
    round: the target-only tokens; the features a head reads are the committed ones after every
    round (the tree pass's accepted path lands in the engine's feature buffer); after every
    commit the head's cache equals a fresh true-feature prefill (its tree entries, made from its
    own predictions, are dropped); and paths of several tokens are accepted."""
    rounds, final = _eagle_stepped("good", gamma=HEAD_TREES[tree])
    _assert_target_tokens(decoding.GenerateOutput.from_state(final))
    m = final.metrics
    assert (np.asarray(m.accepted_at_BG)[:, 1] > 0).any(), "no round accepted two tree nodes"
    _assert_committed_features(rounds, final, _head_config("eagle").feature_layers)
    worst = _head_cache_mismatch("good", gamma=HEAD_TREES[tree])
    assert worst < 1e-4, f"head cache differs from a fresh true-feature prefill by {worst}"


@pytest.mark.parametrize("tree", list(HEAD_TREES))
def test_eagle_tree_nodes_score_as_the_chain_along_their_path(tree):
    """Each tree node's distribution (the q its children are ranked by) equals what the head
    gives when it drafts that node's path as a chain, one token at a time in feature space: a
    tree call reads its parent's output feature, at its path's position. Checked mid-sequence
    (after two rounds), every node of every row."""
    shape = HEAD_TREES[tree]
    # The random head (not 'good', whose output is close to its input feature whatever it is)
    # so that a node scored from another node's feature would differ.
    eng, ep, batch = _eagle_setup("random", shape)
    dr = eng.drafter
    state = eng.init(ep, batch)
    for _ in range(2):
        state, _ = eng.step(ep, GREEDY, state)
    ctx = drafters.DraftContext(tokens_BS=state.tokens_BS, lengths_B=state.lengths_B,
                                target_cache=state.target_cache, features=state.features_BSF)
    keys = jax.random.split(jax.random.key(0), len(PROMPTS))
    draft, q_BN1V, _ = jax.jit(lambda p, s, c, k: dr.propose_tree(p, s, c, k, shape, GREEDY, "deterministic"))(
        ep.draft, state.draft_state, ctx, keys)
    root_BV, cache = jax.jit(lambda p, s, c: dr._catch_up(p, dr._with_features(s, c), c))(ep.draft, state.draft_state,
                                                                                          ctx)
    np.testing.assert_allclose(np.asarray(q_BN1V[:, 0]), np.asarray(jax.nn.softmax(root_BV, -1)), **TOL)
    step = jax.jit(lambda p, t, c: dr.model.apply(p, t, c))
    toks, parents = np.asarray(draft.tokens_BN), np.asarray(draft.parents_BN)
    valid = np.asarray(draft.valid_BN)
    B, N = toks.shape
    paths = [[[] for _ in range(N)] for _ in range(B)]
    for b in range(B):
        for n in range(N):
            par = parents[b, n]
            paths[b][n] = (paths[b][par] if par >= 0 else []) + [n]
    checked = 0
    for n in range(N):
        depth = max(len(paths[b][n]) for b in range(B))
        c = cache.replace(true_BSF=None, drafting=True)
        got = {}
        for j in range(depth):
            col = np.asarray([toks[b, paths[b][n][j]] if j < len(paths[b][n]) else 0 for b in range(B)], np.int32)
            lg, c = step(ep.draft, jnp.asarray(col)[:, None], c)
            for b in range(B):
                if j == len(paths[b][n]) - 1:
                    got[b] = np.asarray(jax.nn.softmax(lg[b, 0], -1))
        for b in range(B):
            # Nodes the tree never forwarded (leaves) carry zero rows that are never read.
            if valid[b, n] and np.asarray(q_BN1V[b, n + 1]).sum() > 0:
                np.testing.assert_allclose(np.asarray(q_BN1V[b, n + 1]), got[b], **TOL)
                checked += 1
    # Every forwarded node: the static tree's 2 + 4 inner nodes, the dynamic tree's frontiers.
    assert checked >= B * (6 if isinstance(shape, trees.TreeShape) else 2), checked


def test_naive_head_commit_is_detected():
    """Negative control for the check above: keeping the slots computed from the head's own
    predicted features (a plain draft model's commit) makes the cache differ."""
    worst = _head_cache_mismatch("good", naive=True)
    assert worst > 1e-2, f"the naive commit was not detected (max difference {worst})"
