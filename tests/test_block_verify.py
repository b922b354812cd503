"""Block verification (Sun et al., ICLR 2025): exactness by enumeration and by sampling,
and never fewer expected accepted tokens than token-level verification."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.verify import BlockVerifier, TokenVerifier

import _tabular as tab

BLOCK = jax.jit(BlockVerifier())
TOKEN = jax.jit(TokenVerifier())


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("kind", ["random", "peaked", "sparse"])
def test_block_round_is_exact_and_beats_token_level(gamma, kind):
    """For random prefix-tree p, q over V=3: one block round followed by target sampling has
    exactly the target's law of G+1 tokens, and E[accepted] >= token-level's."""
    for seed in range(6):
        tree_p = tab.random_tree(seed, 3, kind)
        tree_q = tab.random_tree(seed + 1000, 3, kind)
        law_b, target, acc_b = tab.exact_round_then_target(BLOCK, "block", tree_p, tree_q, 3,
                                                           gamma)
        law_t, _, acc_t = tab.exact_round_then_target(TOKEN, "token", tree_p, tree_q, 3, gamma)
        np.testing.assert_allclose(law_b, target, atol=1e-6)
        np.testing.assert_allclose(law_t, target, atol=1e-6)
        assert acc_b >= acc_t - 1e-6, (seed, acc_b, acc_t)


def test_paper_motivating_example():
    """Sun et al. Sec. 1: binary vocab, target (1/3, 2/3), draft (2/3, 1/3), gamma = 2:
    token-level accepts 10/9 tokens per round on average, block verification 11/9."""
    def tree_p(prefix):
        return np.array([1 / 3, 2 / 3], np.float32)

    def tree_q(prefix):
        return np.array([2 / 3, 1 / 3], np.float32)

    law_b, target, acc_b = tab.exact_round_then_target(BLOCK, "block", tree_p, tree_q, 2, 2)
    _, _, acc_t = tab.exact_round_then_target(TOKEN, "token", tree_p, tree_q, 2, 2)
    np.testing.assert_allclose(law_b, target, atol=1e-6)
    assert acc_t == pytest.approx(10 / 9, abs=1e-6)
    assert acc_b == pytest.approx(11 / 9, abs=1e-6)


def test_gamma_one_equals_token_level():
    """With one draft token block verification reduces to token-level (h_1 = min(1, p/q))."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(5), size=(64, 2)).astype(np.float32)
    q = rng.dirichlet(np.ones(5), size=(64, 1)).astype(np.float32)
    x = np.array([[rng.choice(5, p=qq[0] / qq[0].sum())] for qq in q], np.int32)
    key = jax.random.key(3)
    rb, rt = BLOCK(key, x, q, p), TOKEN(key, x, q, p)
    np.testing.assert_allclose(rb.accept_prob_BG, rt.accept_prob_BG, atol=1e-6)
    np.testing.assert_array_equal(rb.n_accepted_B, rt.n_accepted_B)
    np.testing.assert_allclose(rb.residual_BG1V, rt.residual_BG1V, atol=1e-6)


def test_block_accepts_prefix_token_level_would_reject():
    """The defining difference: a later passing block check overrides an earlier 'rejection'.
    Binary example of the paper with draft 'a a' (ratio 1/2 each): token-level's first check
    passes with prob 1/2 only, but block accepts both tokens whenever eta_2 < h_2 = w_2."""
    p = np.array([[[1 / 3, 2 / 3]] * 3], np.float32)
    q = np.array([[[2 / 3, 1 / 3]] * 2], np.float32)
    x = np.array([[0, 0]], np.int32)
    res = jax.jit(BlockVerifier().verify_with_uniforms)(jnp.array([[0.99, 0.2]]), jax.random.key(0), x, q, p)
    assert float(res.accept_prob_BG[0, 1]) == pytest.approx(0.25, abs=1e-6)  # w_2 = 1/4
    assert int(res.n_accepted_B[0]) == 2
    tok = jax.jit(TokenVerifier().verify_with_uniforms)(jnp.array([[0.99, 0.2]]), jax.random.key(0), x, q, p)
    assert int(tok.n_accepted_B[0]) == 0


@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_block_verification_matches_target_law(gamma):
    n_tokens = gamma + 2
    seqs, stats = tab.generate(BlockVerifier(), gamma, n_tokens, seed=200 + gamma)
    pvalue = tab.sequence_pvalue(seqs, n_tokens)
    print(f"\n[block] gamma={gamma} N={n_tokens}: mean accepted/round={stats['mean_accepted']:.3f}"
          f" rejection rate={stats['rejection_rate']:.3f} p-value={pvalue:.3g}"
          f" (threshold {tab.PER_TEST_ALPHA:.3g})")
    assert pvalue > tab.PER_TEST_ALPHA
