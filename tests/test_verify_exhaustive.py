"""Exhaustive small-vocabulary exactness of token-level and greedy verification.

The marginal of the first committed token is computed exactly from what the verifier
returns (``accept_prob_BG`` and ``residual_BG1V``), one batch row per possible draft token:
    sum_x q(x) [a(x) 1[token = x] + (1 - a(x)) residual_x]  ==  p.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.verify import PAD_TOKEN, GreedyVerifier, TokenVerifier

import _tabular as tab

TOKEN = jax.jit(TokenVerifier())
TOKEN_U = jax.jit(TokenVerifier().verify_with_uniforms)
GREEDY = jax.jit(GreedyVerifier())


def first_token_marginal(p, q):
    """Exact law of the first committed token for gamma = 1, from the verifier's outputs."""
    p = np.asarray(p, np.float32)
    q = np.asarray(q, np.float32)
    vocab = p.shape[-1]
    draft = np.arange(vocab, dtype=np.int32)[:, None]  # row x drafts token x
    q_BGV = np.broadcast_to(q, (vocab, 1, vocab))
    p_BG1V = np.broadcast_to(np.stack([p, p]), (vocab, 2, vocab))
    res = TOKEN(jax.random.key(0), draft, q_BGV, p_BG1V)
    a = np.asarray(res.accept_prob_BG[:, 0], np.float64)
    residual = np.asarray(res.residual_BG1V[:, 0], np.float64)
    marginal = np.zeros(vocab)
    for x in range(vocab):
        marginal[x] += q[x] * a[x]
        marginal += q[x] * (1 - a[x]) * residual[x]
    return marginal, a, residual[0], res


def _norm(x):
    x = np.asarray(x, np.float64)
    return (x / x.sum()).astype(np.float32)


CASES = {
    "identical": (_norm([0.2, 0.5, 0.3]), _norm([0.2, 0.5, 0.3])),
    "disjoint": (_norm([0.7, 0.3, 0.0, 0.0]), _norm([0.0, 0.0, 0.4, 0.6])),
    "near_zero": (_norm([1e-7, 0.6, 0.4 - 1e-7]), _norm([0.3, 1e-8, 0.7])),
    "one_hot_vs_uniform": (_norm([0, 0, 1, 0, 0]), _norm([1, 1, 1, 1, 1])),
    "uniform_vs_one_hot": (_norm([1, 1, 1, 1, 1]), _norm([0, 1, 0, 0, 0])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_first_token_marginal_equals_target(name):
    p, q = CASES[name]
    marginal, _, _, res = first_token_marginal(p, q)
    np.testing.assert_allclose(marginal, p, atol=1e-6)
    assert not np.isnan(np.asarray(res.residual_BG1V)).any()


@pytest.mark.parametrize("vocab", [2, 3, 5, 8])
def test_first_token_marginal_random(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(20):
        conc = rng.choice([0.1, 1.0, 10.0])
        p = _norm(rng.dirichlet(conc * np.ones(vocab)))
        q = _norm(rng.dirichlet(conc * np.ones(vocab)))
        marginal, _, _, _ = first_token_marginal(p, q)
        np.testing.assert_allclose(marginal, p, atol=1e-6)


def test_seed_example_three_tokens():
    """p=[0.5,0.3,0.2], q=[0.6,0.1,0.3]: acceptances 5/6, 1, 2/3; accepted mass 0.8;
    residual all on B (index 1)."""
    p, q = np.array([0.5, 0.3, 0.2], np.float32), np.array([0.6, 0.1, 0.3], np.float32)
    marginal, a, residual, _ = first_token_marginal(p, q)
    np.testing.assert_allclose(a, [5 / 6, 1.0, 2 / 3], atol=1e-6)
    assert float(np.sum(q * a)) == pytest.approx(0.8, abs=1e-6)
    np.testing.assert_allclose(residual, [0.0, 1.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(marginal, p, atol=1e-6)


def test_seed_example_a_b():
    """Target A/B = 80/20, draft 50/50: B accepted 40% of the time, residual all on A."""
    p, q = np.array([0.8, 0.2], np.float32), np.array([0.5, 0.5], np.float32)
    marginal, a, residual, _ = first_token_marginal(p, q)
    assert a[0] == pytest.approx(1.0)
    assert a[1] == pytest.approx(0.4, abs=1e-6)
    np.testing.assert_allclose(residual, [1.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(marginal, p, atol=1e-6)


def test_seed_example_overconfident_draft():
    """Draft puts 90% on a token the target gives 10%: accepted 1/9 = 11.1% of the time, and
    that token gets zero residual mass."""
    p, q = np.array([0.1, 0.9], np.float32), np.array([0.9, 0.1], np.float32)
    marginal, a, residual, _ = first_token_marginal(p, q)
    assert a[0] == pytest.approx(1 / 9, abs=1e-6)
    assert residual[0] == 0.0
    np.testing.assert_allclose(marginal, p, atol=1e-6)


def test_injected_uniforms_decide_acceptance():
    """u * q(x) < p(x) accepts; the first failure stops the row; replacement from residual."""
    p = np.array([[[0.5, 0.3, 0.2]] * 3], np.float32)
    q = np.array([[[0.6, 0.1, 0.3]] * 2], np.float32)
    x = np.array([[0, 2]], np.int32)  # a = 5/6, 2/3
    for u, n in [([0.1, 0.1], 2), ([0.9, 0.1], 0), ([0.5, 0.7], 1), ([0.83, 0.66], 2)]:
        res = TOKEN_U(jnp.array([u], jnp.float32), jax.random.key(1), x, q, p)
        assert int(res.n_accepted_B[0]) == n, (u, n)
        committed = np.asarray(res.committed_BG1[0])
        np.testing.assert_array_equal(committed[:n], x[0, :n])
        if n < 2:
            assert committed[n] == 1  # the residual is all on index 1
        assert (committed[n + 1:] == PAD_TOKEN).all()


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_token_round_then_target_is_exact(gamma):
    """All positions at once: one token-level round followed by target sampling has exactly
    the target's law of G+1 tokens (prefix-dependent random p, q over V=3)."""
    for seed in range(4):
        for kind in ["random", "sparse"]:
            law, target, _ = tab.exact_round_then_target(
                TOKEN, "token", tab.random_tree(seed, 3, kind),
                tab.random_tree(seed + 77, 3, kind), 3, gamma)
            np.testing.assert_allclose(law, target, atol=1e-6)


def test_gamma_zero_commits_one_target_token():
    p = np.array([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]], np.float32)
    draft = np.zeros((2, 0), np.int32)
    q = np.zeros((2, 0, 3), np.float32)
    res = TOKEN(jax.random.key(0), draft, q, p)
    np.testing.assert_array_equal(res.n_accepted_B, [0, 0])
    np.testing.assert_array_equal(res.committed_BG1, [[1], [2]])
    np.testing.assert_array_equal(res.from_draft_BG1, [[False], [False]])


def test_greedy_commits_target_argmax_chain():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(6), size=(32, 4)).astype(np.float32)
    choice = p.argmax(-1)
    draft = choice[:, :3].copy()
    mismatch_at = rng.integers(0, 4, size=32)  # 3 = no mismatch
    for b, m in enumerate(mismatch_at):
        if m < 3:
            draft[b, m] = (draft[b, m] + 1) % 6
    res = GREEDY(jax.random.key(0), draft.astype(np.int32), np.zeros((32, 3, 6), np.float32), p)
    np.testing.assert_array_equal(res.n_accepted_B, mismatch_at)
    for b, m in enumerate(mismatch_at):
        np.testing.assert_array_equal(res.committed_BG1[b, : m + 1], choice[b, : m + 1])
        assert (np.asarray(res.committed_BG1[b, m + 1:]) == PAD_TOKEN).all()
    np.testing.assert_array_equal(res.accept_prob_BG, (draft == choice[:, :3]).astype(np.float32))
    np.testing.assert_array_equal(res.degenerate_residual_B, 0)


def test_greedy_ties_resolve_to_lowest_index():
    p = np.array([[[0.4, 0.4, 0.2], [0.1, 0.45, 0.45]]], np.float32)
    res = GREEDY(jax.random.key(0), np.array([[1]], np.int32), np.zeros((1, 1, 3), np.float32), p)
    assert int(res.n_accepted_B[0]) == 0
    assert int(res.committed_BG1[0, 0]) == 0
