"""Property-based invariants of all verifiers, the degenerate-residual rule, compilation
counts, jit/vmap compatibility, and input validation.

Compilation on the shared CI CPU costs ~1 s per verifier and shape, so the hypothesis test
draws batch (1..3), gamma (0..5) and vocabulary (2..8) but runs every example at the padded
shape [3, gamma, 8]: rows >= batch repeat row 0 and tokens >= vocab have probability 0 in
both p and q (exactly what a padded model vocabulary looks like). Only gamma changes the
compiled shape. ``test_unpadded_shapes`` covers a few genuinely different shapes.
"""

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

from specjax.verify import (
    PAD_TOKEN,
    RESIDUAL_TOL,
    BlockVerifier,
    GreedyVerifier,
    TokenVerifier,
    validate_verify_inputs,
)

B_PAD, V_PAD = 3, 8
VERIFY_U = {
    "token": jax.jit(TokenVerifier().verify_with_uniforms),
    "block": jax.jit(BlockVerifier().verify_with_uniforms),
}
GREEDY = jax.jit(GreedyVerifier())
KINDS = ["random", "one_hot", "near_zero", "disjoint", "identical", "near_equal"]
NEAR_ONE = np.float32(np.nextafter(np.float32(1), np.float32(0)))  # largest float32 < 1


def _normalize(x):
    x = np.asarray(x, np.float64)
    return (x / x.sum(-1, keepdims=True)).astype(np.float32)


def make_pair(rng, kind, vocab):
    """(p, q) for one position over the first ``vocab`` tokens, float32."""
    if kind == "random":
        return _normalize(rng.dirichlet(np.ones(vocab))), _normalize(rng.dirichlet(np.ones(vocab)))
    if kind == "one_hot":
        p = np.eye(vocab, dtype=np.float32)[rng.integers(vocab)]
        choice = rng.integers(3)
        q = (p.copy() if choice == 0 else np.eye(vocab, dtype=np.float32)[rng.integers(vocab)]
             if choice == 1 else _normalize(rng.dirichlet(np.ones(vocab))))
        return p, q
    if kind == "near_zero":  # random, with some entries at 1e-12..1e-7
        out = []
        for _ in range(2):
            d = rng.dirichlet(np.ones(vocab))
            tiny = rng.random(vocab) < 0.4
            tiny[rng.integers(vocab)] = False
            d[tiny] = 10.0 ** rng.uniform(-12, -7, size=tiny.sum())
            out.append(_normalize(d))
        return tuple(out)
    if kind == "disjoint":
        perm = rng.permutation(vocab)
        cut = rng.integers(1, vocab)
        p = np.zeros(vocab)
        q = np.zeros(vocab)
        p[perm[:cut]] = rng.dirichlet(np.ones(cut))
        q[perm[cut:]] = rng.dirichlet(np.ones(vocab - cut))
        return _normalize(p), _normalize(q)
    if kind == "identical":
        p = _normalize(rng.dirichlet(np.ones(vocab)))
        return p, p.copy()
    if kind == "near_equal":  # p == q up to float32 rounding
        p = _normalize(rng.dirichlet(np.ones(vocab)))
        q = _normalize(p.astype(np.float64) * (1 + 2e-7 * rng.standard_normal(vocab)))
        return p, q
    raise ValueError(kind)


def make_instance(seed, batch, gamma, vocab, kinds):
    """Padded arrays: draft [3,G], q [3,G,8], p [3,G+1,8]; drafts sampled from q."""
    rng = np.random.default_rng(seed)
    p = np.zeros((B_PAD, gamma + 1, V_PAD), np.float32)
    q = np.zeros((B_PAD, gamma, V_PAD), np.float32)
    draft = np.zeros((B_PAD, gamma), np.int32)
    for b in range(batch):
        for g in range(gamma + 1):
            pg, qg = make_pair(rng, kinds[b], vocab)
            p[b, g, :vocab] = pg
            if g < gamma:
                q[b, g, :vocab] = qg
                qd = qg.astype(np.float64)
                draft[b, g] = rng.choice(vocab, p=qd / qd.sum())
    for b in range(batch, B_PAD):
        p[b], q[b], draft[b] = p[0], q[0], draft[0]
    kinds = list(kinds[:batch]) + [kinds[0]] * (B_PAD - batch)
    return draft, q, p, kinds


def check_common(res, draft, p, gamma):
    n = np.asarray(res.n_accepted_B)
    committed = np.asarray(res.committed_BG1)
    from_draft = np.asarray(res.from_draft_BG1)
    residual = np.asarray(res.residual_BG1V)
    assert committed.shape == (B_PAD, gamma + 1) and committed.dtype == np.int32
    assert ((n >= 0) & (n <= gamma)).all()
    assert not np.isnan(residual).any() and not np.isnan(np.asarray(res.accept_prob_BG)).any()
    np.testing.assert_allclose(residual.sum(-1), 1.0, atol=1e-5)
    assert not ((residual > 0) & (p == 0)).any(), "residual outside p's support"
    for b in range(B_PAD):
        np.testing.assert_array_equal(from_draft[b], np.arange(gamma + 1) < n[b])
        np.testing.assert_array_equal(committed[b, : n[b]], draft[b, : n[b]])
        assert (committed[b, n[b] + 1:] == PAD_TOKEN).all()
        for j in range(n[b] + 1):
            tok = committed[b, j]
            assert 0 <= tok < V_PAD and p[b, j, tok] > 0, "committed token outside p's support"
    assert set(np.unique(res.degenerate_residual_B)) <= {0, 1}


@hypothesis.given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, B_PAD),
    gamma=st.integers(0, 5),
    vocab=st.integers(2, V_PAD),
    kinds=st.lists(st.sampled_from(KINDS), min_size=B_PAD, max_size=B_PAD),
    u_mode=st.sampled_from(["random", "near_one"]),
)
def test_verifier_invariants(seed, batch, gamma, vocab, kinds, u_mode):
    draft, q, p, kinds = make_instance(seed, batch, gamma, vocab, kinds)
    rng = np.random.default_rng(seed + 1)
    u = (rng.random((B_PAD, gamma)).astype(np.float32) if u_mode == "random"
         else np.full((B_PAD, gamma), NEAR_ONE, np.float32))
    key = jax.random.key(seed)
    for name, fn in VERIFY_U.items():
        res = fn(u, key, draft, q, p)
        check_common(res, draft, p, gamma)
        n = np.asarray(res.n_accepted_B)
        a = np.asarray(res.accept_prob_BG)
        if name == "token":
            qx = np.take_along_axis(q, draft[..., None], -1)[..., 0]
            px = np.take_along_axis(p[:, :gamma], draft[..., None], -1)[..., 0]
            ok = u * qx < px
            want = np.array([int(np.argmin(np.append(row, False))) for row in ok])
            np.testing.assert_array_equal(n, want)
        else:
            passed = u < a
            want = np.array([max([i + 1 for i in range(gamma) if row[i]], default=0)
                             for row in passed])
            np.testing.assert_array_equal(n, want)
        degenerate = np.asarray(res.degenerate_residual_B)
        for b in range(B_PAD):
            if kinds[b] != "near_equal":
                assert degenerate[b] == 0, (name, kinds[b])
            if degenerate[b]:  # the rule: draw from p at that position
                np.testing.assert_array_equal(res.residual_BG1V[b, n[b]], p[b, n[b]])
        if name == "token":  # gamma: residual max(0, p - q) normalized, bonus position p
            np.testing.assert_allclose(res.residual_BG1V[:, gamma], p[:, gamma], atol=1e-7)

    res = GREEDY(key, draft, q, p)
    check_common(res, draft, p, gamma)
    choice = p.argmax(-1)
    n = np.asarray(res.n_accepted_B)
    for b in range(B_PAD):
        np.testing.assert_array_equal(res.committed_BG1[b, : n[b] + 1], choice[b, : n[b] + 1])
    np.testing.assert_array_equal(res.degenerate_residual_B, 0)


@pytest.mark.parametrize("name", ["token", "block"])
def test_degenerate_residual_engineered(name):
    """p == q except rounding-level differences and a rejection forced by u ~ 1: the residual
    mass is ~1e-8 < tau, so the rule fires: the token comes from p and the count is 1."""
    rng = np.random.default_rng(0)
    p = _normalize(rng.dirichlet(np.ones(6)))
    x = int(np.argmax(p))
    y = int(np.argsort(p)[-2])
    q = p.copy()
    for _ in range(3):  # q(x) three ulps above p(x), q(y) three ulps below p(y)
        q[x] = np.nextafter(q[x], np.float32(1))
        q[y] = np.nextafter(q[y], np.float32(0))
    assert 0 < np.maximum(p - q, 0).sum() <= RESIDUAL_TOL
    batch = 4096
    draft = np.full((batch, 1), x, np.int32)
    qq = np.broadcast_to(q, (batch, 1, 6))
    pp = np.broadcast_to(p, (batch, 2, 6))
    u = np.full((batch, 1), NEAR_ONE, np.float32)
    res = VERIFY_U[name](u, jax.random.key(1), draft, qq, pp)
    np.testing.assert_array_equal(res.n_accepted_B, 0)
    np.testing.assert_array_equal(res.degenerate_residual_B, 1)
    np.testing.assert_array_equal(res.residual_BG1V[:, 0], pp[:, 0])
    counts = np.bincount(np.asarray(res.committed_BG1[:, 0]), minlength=6)
    assert (counts[p == 0] == 0).all()
    assert np.abs(counts / batch - p).max() < 0.05  # drawn from p, not a point mass
    # Same inputs with an ordinary uniform: accepted, nothing degenerate.
    res = VERIFY_U[name](np.full((batch, 1), 0.5, np.float32), jax.random.key(1), draft, qq, pp)
    np.testing.assert_array_equal(res.degenerate_residual_B, 0)


def test_call_equals_injected_uniforms():
    draft, q, p, _ = make_instance(3, 3, 3, 5, ["random"] * 3)
    key = jax.random.key(42)
    for name, verifier in [("token", TokenVerifier()), ("block", BlockVerifier())]:
        res = jax.jit(verifier)(key, draft, q, p)
        again = VERIFY_U[name](res.uniforms_BG, key, draft, q, p)
        chex.assert_trees_all_equal(res, again)
        assert ((np.asarray(res.uniforms_BG) >= 0) & (np.asarray(res.uniforms_BG) < 1)).all()


@pytest.mark.parametrize("verifier", [TokenVerifier(), BlockVerifier(), GreedyVerifier()],
                         ids=["token", "block", "greedy"])
def test_compiles_once_per_shape(verifier):
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(key, draft, q, p):
        return verifier(key, draft, q, p)

    for seed in range(3):  # new values, same shapes: no retrace
        draft, q, p, _ = make_instance(seed, 3, 2, 4 + seed, ["random"] * 3)
        run(jax.random.key(seed), draft, q, p)
    draft, q, p, _ = make_instance(0, 3, 3, 4, ["random"] * 3)
    with pytest.raises(AssertionError):  # a new shape is a new trace: the counter works
        run(jax.random.key(0), draft, q, p)


def _apply_verifier(verifier, key, draft, q, p):
    return verifier(key, draft, q, p)


def test_verifiers_are_static_jit_arguments_and_vmap():
    assert hash(TokenVerifier()) == hash(TokenVerifier()) and TokenVerifier() == TokenVerifier()
    chex.clear_trace_counter()
    # One trace per verifier class: equal (hash-equal) verifiers share their compilation.
    apply = jax.jit(chex.assert_max_traces(_apply_verifier, n=3), static_argnums=0)
    draft, q, p, _ = make_instance(5, 3, 2, 5, ["random"] * 3)
    keys = jax.random.split(jax.random.key(9), 2)
    stacked = [np.stack([a, a[::-1]]) for a in (draft, q, p)]
    for verifier in [TokenVerifier(), BlockVerifier(), GreedyVerifier()]:
        out = jax.jit(jax.vmap(verifier))(keys, *stacked)
        for i in range(2):
            one = apply(verifier, keys[i], *(s[i] for s in stacked))
            chex.assert_trees_all_close(jax.tree.map(lambda t: t[i], out), one, atol=1e-6)
    apply(TokenVerifier(), keys[0], draft, q, p)  # a fresh but equal verifier: no retrace


def test_unpadded_shapes():
    for batch, gamma, vocab in [(1, 0, 2), (5, 4, 7)]:
        rng = np.random.default_rng(batch)
        p = rng.dirichlet(np.ones(vocab), size=(batch, gamma + 1)).astype(np.float32)
        q = rng.dirichlet(np.ones(vocab), size=(batch, gamma)).astype(np.float32)
        draft = rng.integers(0, vocab, size=(batch, gamma)).astype(np.int32)
        for verifier in [TokenVerifier(), BlockVerifier(), GreedyVerifier()]:
            res = jax.jit(verifier)(jax.random.key(0), draft, q, p)
            assert res.committed_BG1.shape == (batch, gamma + 1)
            assert res.residual_BG1V.shape == (batch, gamma + 1, vocab)
            n = np.asarray(res.n_accepted_B)
            assert ((n >= 0) & (n <= gamma)).all()
            assert (np.asarray(res.num_committed_B) == n + 1).all()


# --------------------------------------------------------------------------- validation


def _good():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(4), size=(2, 3)).astype(np.float32)
    q = rng.dirichlet(np.ones(4), size=(2, 2)).astype(np.float32)
    draft = np.array([[0, 1], [2, 3]], np.int32)
    return draft, q, p


def test_validation_accepts_good_inputs():
    validate_verify_inputs(*_good())
    validate_verify_inputs(np.zeros((2, 0), np.int32), np.zeros((2, 0, 4)),
                           np.full((2, 1, 4), 0.25))


def _bad(case):
    draft, q, p = _good()
    if case == "vocab":
        return draft, q, np.concatenate([p, np.zeros((2, 3, 1), np.float32)], -1)
    if case == "nan":
        q = q.copy(); q[1, 0, 2] = np.nan
    elif case == "negative":
        p = p.copy(); p[0, 2, 1] = -0.1; p[0, 2, 0] += 0.1
    elif case == "sum":
        p = p.copy(); p[1, 1] *= 1.1
    elif case == "negative_gamma":
        return np.zeros((2, 0), np.int32), np.zeros((2, 0, 4)), np.zeros((2, 0, 4))
    elif case == "gamma_p":
        return draft, q, p[:, :2]
    elif case == "gamma_q":
        return draft, q[:, :1], p
    elif case == "batch":
        return draft, q, p[:1]
    elif case == "range":
        draft = draft.copy(); draft[1, 1] = 4
    elif case == "negative_token":
        draft = draft.copy(); draft[0, 0] = -1
    elif case == "rank":
        return draft[0], q, p
    elif case == "support":
        q = q.copy(); q[0, 0] = [0.0, 0.5, 0.25, 0.25]
    return draft, q, p


@pytest.mark.parametrize("case,message", [
    ("vocab", "vocab sizes differ"),
    ("nan", "NaN"),
    ("negative", "negative probabilities"),
    ("sum", "sum to 1"),
    ("negative_gamma", "negative gamma"),
    ("gamma_p", "p_BG1V has 2"),
    ("gamma_q", "q_BGV has 1"),
    ("batch", "batch sizes disagree"),
    ("range", "out of range"),
    ("negative_token", "out of range"),
    ("rank", "shape \\[B, G\\]"),
    ("support", "zero probability under q_BGV"),
])
def test_validation_errors_name_the_problem(case, message):
    with pytest.raises(ValueError, match=message):
        validate_verify_inputs(*_bad(case))
