"""Greedy exactness of the generation loop on toy models.

At temperature 0, speculative decoding (`Engine.run` with a drafter) must return exactly the
tokens (and statuses) of target-only decoding (an `Engine` with gamma = 0), for every row,
whatever the drafter proposes: a draft table close to the target's, an independent one that
disagrees often, prompt lookup (n-gram), and the target itself (everything accepted). Fixed
gamma 1..4 with each drafter and `AdaptiveGamma` (with gamma 0 in its set); 'token' and 'block'
verifier configs (greedy always verifies greedily). Batch 1 and batch 4 with mixed prompt lengths.

Compile budget: one compiled loop per (batch, drafter class, gamma setting, verifier config);
the close / disagreeing / self drafts are the same `ModelDrafter` with different params, so
they share a compilation. Runs are memoised per module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import decoding, drafters, sampling

from _toy import TabularModel, random_table

V = 8
MAX_NEW = 24
PROMPTS_B4 = [[5], [1, 2, 3, 4], [7, 0, 3, 3, 1, 6], [2, 2]]
PROMPTS_B1 = [PROMPTS_B4[2]]           # the longest one: same padded width and capacity
ADAPTIVE = decoding.AdaptiveGamma(gammas=(0, 1, 3), probe_every=3)     # gamma 0 and two block sizes
GREEDY = sampling.SamplingConfig.make(0.0)

TARGET = TabularModel(V)
MODEL_DRAFTER = drafters.ModelDrafter(TabularModel(V))
NGRAM_DRAFTER = drafters.NGramDrafter(V)
DRAFT_KINDS = ("close", "disagree", "self")


def de_bruijn_successor(vocab):
    """succ[a, b]: the token after the pair (a, b) in a de Bruijn cycle of order 2 (every pair
    occurs once in a cycle of length vocab^2), so greedy decoding never settles into a short
    loop and visits every (prev, cur) pair."""
    a = [0] * (2 * vocab)
    seq = []

    def db(t, p):
        if t > 2:
            if 2 % p == 0:
                seq.extend(a[1:p + 1])
        else:
            a[t] = a[t - p]
            db(t + 1, p)
            for j in range(a[t - p] + 1, vocab):
                a[t] = j
                db(t + 1, t)

    db(1, 1)
    n = len(seq)
    assert n == vocab * vocab
    succ = np.zeros((vocab, vocab), np.int64)
    for i in range(n):
        succ[seq[i], seq[(i + 1) % n]] = seq[(i + 2) % n]
    return succ


def cycle_table(key, succ, margin=4.0):
    """Prefix-dependent logits whose argmax given (prev, cur) is succ[prev, cur]."""
    noise = random_table(key, V, peak=1.0)
    return noise + margin * jax.nn.one_hot(jnp.asarray(succ), V)


@pytest.fixture(scope="module")
def env():
    succ = de_bruijn_successor(V)
    tt = cycle_table(jax.random.key(0), succ)
    # close: the same successor except on ~1/4 of the pairs
    flip = np.random.default_rng(1).random((V, V)) < 0.25
    tables = {
        "close": cycle_table(jax.random.key(1), np.where(flip, (succ + 1) % V, succ)),
        "disagree": random_table(jax.random.key(2), V, peak=3.0),
        "self": tt,
    }
    batches = {"b4": PROMPTS_B4, "b1": PROMPTS_B1}
    return dict(tt=tt, tables=tables, batches=batches, runs={})


def _generate(env, batch, drafter, draft_params, config, round_time_s=None):
    """One jitted run; the batch's capacity is the default for `config` (as before the API change)."""
    b = decoding.make_batch(env["batches"][batch], config, jax.random.key(5))
    engine = decoding.Engine(TARGET, drafter, config)
    return engine.run(decoding.EngineParams(target=env["tt"], draft=draft_params), GREEDY, b,
                      round_time_s=round_time_s)


def _ar(env, batch, eos_ids=()):
    key = ("ar", batch, eos_ids)
    if key not in env["runs"]:
        config = decoding.GenerationConfig(MAX_NEW, gamma=0, eos_ids=eos_ids)
        env["runs"][key] = _generate(env, batch, None, None, config)
    return env["runs"][key]


def _spec(env, batch, draft, gamma, verifier="token", eos_ids=(), round_time_s=None):
    key = ("spec", batch, draft, gamma, verifier, eos_ids, None if round_time_s is None else tuple(round_time_s))
    if key not in env["runs"]:
        if draft == "ngram":
            drafter, params = NGRAM_DRAFTER, None
        else:
            drafter, params = MODEL_DRAFTER, env["tables"][draft]
        config = decoding.GenerationConfig(MAX_NEW, gamma=gamma, verifier=verifier, eos_ids=eos_ids)
        env["runs"][key] = _generate(env, batch, drafter, params, config, round_time_s)
    return env["runs"][key]


def _check_metrics(out, gamma):
    m = out.metrics
    gen = np.asarray(out.lengths_B) - np.asarray(out.prompt_lengths_B)
    np.testing.assert_array_equal(np.asarray(m.committed_B), gen)
    acc, prop, rounds = (np.asarray(x) for x in (m.accepted_B, m.proposed_B, m.rounds_B))
    assert (acc <= prop).all() and (rounds >= 1).all()
    assert (gen <= acc + rounds).all()               # a round commits at most n_accepted + 1
    if isinstance(gamma, int):
        np.testing.assert_array_equal(prop, gamma * rounds)
        np.testing.assert_array_equal(np.asarray(m.accepted_at_BG).sum(1), acc)
        # tested positions: accepted ones + the rejected one (if any) per round
        tested = np.asarray(m.tested_at_BG).sum(1)
        full = np.asarray(m.accepted_at_BG)[:, gamma - 1]
        np.testing.assert_array_equal(tested, acc + rounds - full)


def _assert_same_as_ar(out, ref):
    assert out.generated() == ref.generated()
    np.testing.assert_array_equal(np.asarray(out.status_B), np.asarray(ref.status_B))
    np.testing.assert_array_equal(np.asarray(out.lengths_B), np.asarray(ref.lengths_B))
    # the whole buffer (prompt, generated, PAD tail) is identical; capacities differ by gamma
    a, b = np.asarray(out.tokens_BS), np.asarray(ref.tokens_BS)
    w = min(a.shape[1], b.shape[1])
    np.testing.assert_array_equal(a[:, :w], b[:, :w])
    assert (a[:, w:] == decoding.PAD_ID).all() and (b[:, w:] == decoding.PAD_ID).all()


# (batch, drafter kind, gamma, verifier config); ModelDrafter cases run all three tables. Every
# fixed gamma 1..4 runs with each drafter (a gamma is a static size of the same loop: each one
# once per drafter, with either verifier config), gamma 1 (a single draft) and 4 and the adaptive
# policy with each drafter and the token verifier; the block verifier with both drafters; batch 1
# with both drafters and the adaptive policy.
CASES = (
    [("b4", "model", g, "token") for g in (1, 3, 4, ADAPTIVE)]
    + [("b4", "ngram", g, "token") for g in (1, 4, ADAPTIVE)]
    + [("b4", "model", 2, "block"), ("b4", "model", 4, "block"), ("b4", "model", ADAPTIVE, "block"),
       ("b4", "ngram", 3, "block")]
    + [("b1", "model", g, "token") for g in (3, ADAPTIVE)] + [("b1", "ngram", 2, "block")]
)


def _case_id(case):
    b, d, g, v = case
    return f"{b}-{d}-{'adaptive' if isinstance(g, decoding.AdaptiveGamma) else f'g{g}'}-{v}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_greedy_speculative_equals_autoregressive(env, case):
    batch, drafter, gamma, verifier = case
    ref = _ar(env, batch)
    assert (np.asarray(ref.status_B) == decoding.MAX_TOKENS).all()
    assert all(len(g) == MAX_NEW for g in ref.generated())
    for draft in (DRAFT_KINDS if drafter == "model" else ("ngram",)):
        out = _spec(env, batch, draft, gamma, verifier)
        _assert_same_as_ar(out, ref)
        _check_metrics(out, gamma)
        if draft == "self" and isinstance(gamma, int):
            # the target as its own draft: every proposal is the target's argmax
            np.testing.assert_array_equal(np.asarray(out.metrics.accepted_B),
                                          np.asarray(out.metrics.proposed_B))


def test_acceptance_ordering_by_draft_quality(env):
    """Sanity of the fixtures: the self draft accepts all, the close one most, the
    independent one least (so the suite really exercises rejections)."""
    rates = {}
    for draft in DRAFT_KINDS:
        m = _spec(env, "b4", draft, 3).metrics
        rates[draft] = np.asarray(m.accepted_B).sum() / np.asarray(m.proposed_B).sum()
    print("\nacceptance rate per draft (gamma 3):", rates)
    assert rates["self"] == 1.0
    assert rates["close"] > rates["disagree"] + 0.2
    assert rates["disagree"] < 0.6


def test_batch_one_equals_its_row_in_batch_four(env):
    for gamma in (3, ADAPTIVE):
        b1 = _spec(env, "b1", "close", gamma).generated()[0]
        b4 = _spec(env, "b4", "close", gamma).generated()[2]
        assert b1 == b4


def test_greedy_with_eos_equals_autoregressive(env):
    # EOS = a token the reference produces in the middle of row 0's continuation
    eos = _ar(env, "b4").generated()[0][7]
    ref = _ar(env, "b4", eos_ids=(eos,))
    status = np.asarray(ref.status_B)
    assert (status == decoding.EOS).any()
    for draft in DRAFT_KINDS:
        out = _spec(env, "b4", draft, 3, eos_ids=(eos,))
        _assert_same_as_ar(out, ref)
        for row in out.generated():
            assert eos not in row[:-1]          # stops at the first EOS


def test_adaptive_uses_several_gammas_and_stays_exact(env):
    out = _spec(env, "b4", "disagree", ADAPTIVE)
    k = np.asarray(out.metrics.gamma_rounds_Z)
    print("\nadaptive gamma rounds (0,1,3):", k)
    assert (k > 0).sum() >= 2, "the policy should switch gamma on a poor draft"
    _assert_same_as_ar(out, _ar(env, "b4"))


def test_adaptive_self_draft_accepts_everything_after_gamma_zero_rounds(env):
    """With the target as its own draft every proposal must be accepted, also after rounds
    the adaptive policy ran at gamma 0 (expensive draft rounds force gamma 0 at the start;
    probes then try gamma 1). The draft cache has to catch up on every token committed while
    it was not called; a drafter that only ingests the 1-2 newest tokens falls behind for good
    and proposes continuations of a stale prefix."""
    out = _spec(env, "b1", "self", ADAPTIVE, round_time_s=(1.0, 1.9, 3.7))
    _assert_same_as_ar(out, _ar(env, "b1"))
    k = np.asarray(out.metrics.gamma_rounds_Z)
    m = out.metrics
    print("\nadaptive gamma rounds (0,1,3):", k, "accepted", np.asarray(m.accepted_B),
          "proposed", np.asarray(m.proposed_B))
    assert k[0] >= 2 and k[1:].sum() >= 1, "precondition: gamma-0 rounds followed by positive ones"
    np.testing.assert_array_equal(np.asarray(m.proposed_B), (np.asarray(ADAPTIVE.gammas) * k).sum())
    np.testing.assert_array_equal(np.asarray(m.accepted_B), np.asarray(m.proposed_B))


def test_suite_saw_rejections_and_fully_accepted_rounds(env):
    rejections = full_rounds = 0
    for batch, drafter, gamma, verifier in CASES:
        if not isinstance(gamma, int):
            continue
        for draft in (DRAFT_KINDS if drafter == "model" else ("ngram",)):
            m = _spec(env, batch, draft, gamma, verifier).metrics
            tested, accepted = np.asarray(m.tested_at_BG), np.asarray(m.accepted_at_BG)
            rejections += int(tested.sum() - accepted.sum())
            full_rounds += int(accepted[:, gamma - 1].sum())
    print(f"\nrejections: {rejections}, fully accepted rounds: {full_rounds}")
    assert rejections > 50
    assert full_rounds > 50
